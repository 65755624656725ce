"""Data-parallel replicas on Ray Serve behind one OpenAI endpoint.

``replica.py``: the Serve deployment, one AsyncEngine per replica. ``router.py``: Ray Serve's
request-router extension point running a conveyor.routing policy. ``fleet.py``: the engine-like
object the OpenAI app (entrypoints/openai) serves over, with fleet-wide /metrics and /health.
``launcher.py``: `conveyor serve --data-parallel-size N`.
"""
