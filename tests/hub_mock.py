"""A local stand-in for the Hugging Face Hub's HTTP API, for download tests (set HF_ENDPOINT to `url`).

It answers what `huggingface_hub` asks, with the hub's response headers:
`GET /api/models/{repo}/revision/{rev}` (model info: sha, siblings),
`GET /api/models/{repo}/tree/{rev}[/{path}]` (files with size, oid and lfs sha256),
`HEAD|GET /{repo}/resolve/{rev}/{path}` with X-Repo-Commit, ETag, X-Linked-Etag,
X-Linked-Size, Accept-Ranges, and 206 + Content-Range for a Range request.
Faults for tests: `cut_once[path] = n` drops the connection after n bytes of the next
GET of path; `corrupt_once.add(path)` serves it once with one byte flipped; with
`token` set, a request without `Authorization: Bearer TOKEN` gets the hub's 401. Every
request is logged in `requests` as (method, path, Range header).
"""

from __future__ import annotations

import hashlib
import socket
import threading
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


class MockHub:
    def __init__(self, repo_id: str, files: dict[str, bytes], commit: str = "c0ffee" + "0" * 34,
                 lfs_min: int = 1024) -> None:
        self.repo_id = repo_id
        self.files = files
        self.commit = commit
        self.lfs_min = lfs_min  # files at least this big are LFS files (sha256 in the listing)
        self.requests: list[tuple[str, str, str | None]] = []
        self.authorization: list[str | None] = []  # the Authorization header of every request
        self.cut_once: dict[str, int] = {}
        self.corrupt_once: set[str] = set()
        self.token: str | None = None
        self.bytes_served = 0
        # Body bytes sent per request, by its index in `requests`: a cancelled download's
        # response may still be streaming after the client gave up, so counts taken
        # between runs go by request, not by the total.
        self.served_by_request: dict[int, int] = {}
        self.url = ""
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    # -- the API -----------------------------------------------------------------------------
    def _entry(self, path: str) -> dict:
        data = self.files[path]
        e = {"type": "file", "oid": git_blob_id(data), "size": len(data), "path": path}
        if len(data) >= self.lfs_min:
            e["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return e

    def _repo_ok(self, request: Request) -> bool:
        p = request.path_params
        return f"{p['namespace']}/{p['name']}" == self.repo_id

    def _denied(self, request: Request) -> Response | None:
        if self.token is None or request.headers.get("authorization") == f"Bearer {self.token}":
            return None
        return JSONResponse({"error": "Invalid username or password."}, status_code=401)

    async def revision(self, request: Request) -> Response:
        self.requests.append(("GET", request.url.path, None))
        if denied := self._denied(request):
            return denied
        if not self._repo_ok(request):
            return JSONResponse({"error": "Repository not found"}, status_code=404,
                                headers={"X-Error-Code": "RepoNotFound"})
        return JSONResponse({"_id": "x", "id": self.repo_id, "modelId": self.repo_id, "sha": self.commit,
                             "private": False, "disabled": False, "gated": False, "tags": ["gguf"],
                             "siblings": [{"rfilename": p} for p in sorted(self.files)]})

    async def tree(self, request: Request) -> Response:
        self.requests.append(("GET", request.url.path, None))
        if not self._repo_ok(request):
            return JSONResponse({"error": "Repository not found"}, status_code=404)
        prefix = request.path_params.get("path", "").strip("/")
        recursive = request.query_params.get("recursive", "false").lower() == "true"
        out, dirs = [], set()
        for path in sorted(self.files):
            if prefix and not path.startswith(prefix + "/"):
                continue
            rest = path[len(prefix) + 1 :] if prefix else path
            if "/" in rest and not recursive:
                dirs.add(((prefix + "/") if prefix else "") + rest.split("/")[0])
                continue
            if recursive:
                parts = path.split("/")[:-1]
                for i in range(len(prefix.split("/")) if prefix else 0, len(parts)):
                    dirs.add("/".join(parts[: i + 1]))
            out.append(self._entry(path))
        out += [{"type": "directory", "oid": "0" * 40, "size": 0, "path": d} for d in sorted(dirs)]
        return JSONResponse(out)

    async def resolve(self, request: Request) -> Response:
        path = request.path_params["path"]
        rng = request.headers.get("range")
        self.authorization.append(request.headers.get("authorization"))
        self.requests.append((request.method, path, rng))
        index = len(self.requests) - 1
        if not self._repo_ok(request) or path not in self.files:
            return Response(status_code=404, headers={"X-Error-Code": "EntryNotFound", "X-Repo-Commit": self.commit})
        data = self.files[path]
        entry = self._entry(path)
        headers = {"X-Repo-Commit": self.commit, "ETag": f'"{entry["oid"]}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        if "lfs" in entry:
            headers["X-Linked-Etag"] = f'"{entry["lfs"]["oid"]}"'
            headers["X-Linked-Size"] = str(len(data))
        if request.method == "HEAD":
            headers["Content-Length"] = str(len(data))
            return Response(status_code=200, headers=headers)
        start, status = 0, 200
        if rng:
            start = int(rng.split("=")[1].split("-")[0])
            if start >= len(data):
                return Response(status_code=416, headers={**headers, "Content-Range": f"bytes */{len(data)}"})
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            status = 206
        body = data[start:]
        if path in self.corrupt_once:
            self.corrupt_once.discard(path)
            mid = len(body) // 2
            body = body[:mid] + bytes([body[mid] ^ 0xFF]) + body[mid + 1 :]
        headers["Content-Length"] = str(len(body))
        cut = self.cut_once.pop(path, None)

        async def stream():
            step = 4096
            for a in range(0, len(body), step):
                if cut is not None and a >= cut:
                    raise ConnectionResetError("mock hub: connection dropped on purpose")
                chunk = body[a : a + step]
                self.bytes_served += len(chunk)
                self.served_by_request[index] = self.served_by_request.get(index, 0) + len(chunk)
                yield chunk

        return StreamingResponse(stream(), status_code=status, headers=headers)

    def app(self) -> Starlette:
        repo = "/{namespace}/{name}"
        return Starlette(routes=[
            Route(f"/api/models{repo}/revision/{{rev:path}}", self.revision),
            Route(f"/api/models{repo}/tree/{{rev}}/{{path:path}}", self.tree),
            Route(f"/api/models{repo}/tree/{{rev}}", self.tree),
            Route(f"{repo}/resolve/{{rev}}/{{path:path}}", self.resolve, methods=["GET", "HEAD"]),
        ])

    # -- lifetime --------------------------------------------------------------------------------
    def __enter__(self) -> MockHub:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(self.app(), log_level="error", lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self._server.started, "the mock hub did not start"
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._server is not None and self._thread is not None
        self._server.should_exit = True
        self._thread.join(10)
