"""A local HTTP server speaking the Hugging Face Hub's API shape, for the model-pull tests
(``HF_ENDPOINT`` points at it; nothing reaches the real Hub): ``GET /api/models/<repo>``
(``?blobs=true``: sizes, git blob ids and LFS sha256s) and ``HEAD``/``GET
/<repo>/resolve/<revision>/<file>`` with the Hub's headers (``X-Repo-Commit``, ``ETag``) and
byte ranges. ``cut_next[file] = n`` makes the next download of ``file`` stop after ``n`` bytes
with the connection closed; ``requests`` records each (method, path, Range)."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def _lfs(name: str, data: bytes) -> bool:
    return name.endswith((".gguf", ".safetensors")) or len(data) > 10_000


class FakeHub:
    def __init__(self, repos: dict[str, dict[str, bytes | Path]]) -> None:
        self.files: dict[str, dict[str, bytes]] = {
            repo: {name: (src.read_bytes() if isinstance(src, Path) else src)
                   for name, src in files.items()} for repo, files in repos.items()}
        self.commits = {repo: hashlib.sha1(repo.encode()).hexdigest() for repo in repos}
        self.cut_next: dict[str, int] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def downloads(self, name: str) -> list[str | None]:
        """The Range header of each GET of a file named ``name`` (None: from the start)."""
        return [rng for method, path, rng in self.requests
                if method == "GET" and path.endswith("/" + name)]

    def _sibling(self, name: str, data: bytes) -> dict:
        blob = hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()
        out = {"rfilename": name, "size": len(data), "blobId": blob}
        if _lfs(name, data):
            out["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                          "pointerSize": 134}
        return out

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _json(self, status: int, obj: dict) -> None:
                body = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                if status >= 400:
                    self.send_header("X-Error-Code", "RepoNotFound")
                self.end_headers()
                self.wfile.write(body)

            def _route(self, head: bool) -> None:
                path = self.path.split("?", 1)[0]
                hub.requests.append((self.command, path, self.headers.get("Range")))
                api = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/[^/]+)?", path)
                if api:
                    repo = api.group(1)
                    if repo not in hub.files:
                        return self._json(404, {"error": "Repository not found"})
                    return self._json(200, {
                        "id": repo, "modelId": repo, "sha": hub.commits[repo], "private": False,
                        "siblings": [hub._sibling(n, d) for n, d in hub.files[repo].items()]})
                res = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
                if not res or res.group(1) not in hub.files or \
                        res.group(3) not in hub.files[res.group(1)]:
                    return self._json(404, {"error": "Entry not found"})
                repo, name = res.group(1), res.group(3)
                data = hub.files[repo][name]
                sibling = hub._sibling(name, data)
                etag = sibling["lfs"]["sha256"] if "lfs" in sibling else sibling["blobId"]
                start = 0
                rng = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
                if rng and not head:
                    start = int(rng.group(1))
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", hub.commits[repo])
                self.send_header("ETag", f'"{etag}"')
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(len(data) - start))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if head:
                    return
                cut = hub.cut_next.pop(name, None)
                if cut is not None:  # a cut connection: part of the body, then closed
                    self.wfile.write(data[start:cut])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.wfile.write(data[start:])

            def do_HEAD(self) -> None:  # noqa: N802
                self._route(head=True)

            def do_GET(self) -> None:  # noqa: N802
                self._route(head=False)

        return Handler
