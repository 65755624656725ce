"""Tensor parallelism across processes: the process group (``group.py``), the per-step message
rank 0 broadcasts (``step.py``), the worker loop of the other ranks (``worker.py``) and rank 0's
handle on them (``workers.py``). The sharded layers themselves are ``model/layers/parallel.py``.
"""
