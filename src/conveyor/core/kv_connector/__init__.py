"""The KV connector: moving KV blocks beyond one engine's pool, keyed by content.

Pure Python (no torch), like the rest of ``core``: content keys (``keys``), the interface
between the connector's scheduler half and its runner half and the ops a step carries
(``interface``), the offload tiers' scheduler half (``offload``, ``tier_index``, ``config``),
the pool's hooks (``pool_observer``) and KV events (``events``). The runner half lives beside
the model runner (``executor/kv_offload_worker.py``). docs/kv_cache.md describes the whole.
"""
