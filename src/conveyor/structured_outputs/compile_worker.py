"""A grammar-compile worker process (``python -m conveyor.structured_outputs.compile_worker FD``).

It talks to ``CompilePool`` over the socket ``FD``: first the tokenizer's xgrammar info (JSON),
answered with ``"ready"``; then, per job, ``(params, max_bytes)`` answered with ``("ok", the
compiled grammar's JSON)`` or ``("error", message)``. It exits when the socket closes. Running
apart from the engine is what lets a compile be stopped: ending this process frees all it held.
"""

from __future__ import annotations

import os
import sys
from multiprocessing.connection import Connection


def main(fd: int) -> None:
    os.dup2(2, 1)  # stray prints of the libraries go to stderr; the socket carries the protocol
    import xgrammar as xgr

    from conveyor.structured_outputs.compiler import compile_params, explain

    conn = Connection(fd)
    try:
        info = xgr.TokenizerInfo.deserialize_json(conn.recv())
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        conn.send("ready")
        while True:
            params, max_bytes = conn.recv()
            try:
                grammar = compile_params(compiler, params)
            except Exception as e:  # xgrammar's parser errors: RuntimeError / ValueError
                conn.send(("error", explain(params, e)))
                continue
            size = grammar.memory_size_bytes
            if size > max_bytes:
                conn.send(("error", f"structured_outputs.{params.kind} compiles to a grammar of "
                           f"{size:,} bytes; at most {max_bytes:,} are allowed "
                           "(a quarter of --structured-outputs-cache-bytes)"))
                continue
            conn.send(("ok", grammar.serialize_json()))
    except (EOFError, OSError):  # the engine closed the socket or went away
        return


if __name__ == "__main__":
    main(int(sys.argv[1]))
