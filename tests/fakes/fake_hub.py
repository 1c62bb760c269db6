"""fake_hub: a real HTTP server speaking the part of the Hugging Face Hub's protocol that
huggingface_hub's ``snapshot_download`` / ``hf_hub_download`` use, for repos served from local directories.

Why a fake: the Hub is a boundary tests cannot reach (no network in CI, and a real download would
depend on someone else's repository). Everything on our side of it is real: huggingface_hub itself,
pointed here by ``HF_ENDPOINT``, resolves the revision, lists the tree, HEADs and GETs each file and
lays out its cache (blobs, snapshots, refs) as it does against huggingface.co.

Endpoints (read from huggingface_hub 2.4's hf_api.py / file_download.py; models only):

    GET  /api/models/{org}/{name}[/revision/{rev}]     {"id", "sha", "siblings": [{"rfilename"}]}
    GET  /api/models/{org}/{name}/tree/{rev}[/path]    [{"type": "file", "path", "size", "oid"}]
    HEAD /{org}/{name}/resolve/{rev}/{file}            X-Repo-Commit, ETag (the git blob id), Content-Length
    GET  /{org}/{name}/resolve/{rev}/{file}            the bytes, same headers

An unknown repo answers 404 with ``X-Error-Code: RepoNotFound``, an unknown revision (anything but
``main`` or the commit) ``RevisionNotFound``, an unknown file ``EntryNotFound``: the headers
huggingface_hub turns into its typed errors. Every request is recorded (:attr:`FakeHub.requests`)
so a test can tell a download from a cache hit.
"""
from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

COMMIT = "fa11ba5e0123456789abcdef0123456789abcdef"


def git_blob_id(data: bytes) -> str:
    """The id git (and the Hub's tree API) gives a file's content."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    """``with FakeHub({"org/name": directory}) as hub:`` serves on ``hub.endpoint`` (127.0.0.1, a free port)."""

    def __init__(self, repos: dict[str, Path], commit: str = COMMIT):
        self.repos = {r: Path(d) for r, d in repos.items()}
        self.commit = commit
        self.requests: list[tuple[str, str]] = []  # (method, path)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                hub._answer(self, body=True)

            def do_HEAD(self):  # noqa: N802
                hub._answer(self, body=False)

            def log_message(self, *args):  # quiet: pytest shows failures, not access logs
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="fake_hub", daemon=True)

    def __enter__(self) -> "FakeHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)

    def downloads(self) -> list[str]:
        """The file paths fetched with GET (not HEAD, not the API)."""
        return [p for m, p in self.requests if m == "GET" and "/resolve/" in p]

    def _files(self, repo: str) -> list[str]:
        return sorted(p.name for p in self.repos[repo].iterdir() if p.is_file())

    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        self.requests.append((h.command, path))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo, rest = "/".join(parts[2:4]), parts[4:]
            if repo not in self.repos:
                return _error(h, 404, "RepoNotFound", f"Repository {repo} not found")
            if rest and rest[0] in ("revision", "tree") and len(rest) >= 2 and rest[1] not in ("main", self.commit):
                return _error(h, 404, "RevisionNotFound", f"Invalid rev id: {rest[1]}")
            if rest and rest[0] == "tree":
                files = self._files(repo)
                data = [{"type": "file", "path": f, "size": (self.repos[repo] / f).stat().st_size,
                         "oid": git_blob_id((self.repos[repo] / f).read_bytes())} for f in files]
                return _json(h, data, body)
            return _json(h, {"id": repo, "modelId": repo, "sha": self.commit, "private": False,
                             "siblings": [{"rfilename": f} for f in self._files(repo)]}, body)
        if len(parts) >= 5 and parts[2] == "resolve":
            repo, rev, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            if repo not in self.repos:
                return _error(h, 404, "RepoNotFound", f"Repository {repo} not found")
            if rev not in ("main", self.commit):
                return _error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
            f = self.repos[repo] / name
            if not f.is_file():
                return _error(h, 404, "EntryNotFound", f"{name} does not exist at {rev}")
            data = f.read_bytes()
            h.send_response(200)
            h.send_header("X-Repo-Commit", self.commit)
            h.send_header("ETag", f'"{git_blob_id(data)}"')
            h.send_header("Content-Length", str(len(data)))
            h.send_header("Content-Type", "application/octet-stream")
            h.end_headers()
            if body:
                h.wfile.write(data)
            return
        return _error(h, 404, "", f"not a Hub endpoint: {path}")


def _json(h: BaseHTTPRequestHandler, data, body: bool) -> None:
    raw = json.dumps(data).encode()
    h.send_response(200)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(raw)))
    h.end_headers()
    if body:
        h.wfile.write(raw)


def _error(h: BaseHTTPRequestHandler, status: int, code: str, message: str) -> None:
    raw = json.dumps({"error": message}).encode()
    h.send_response(status)
    if code:
        h.send_header("X-Error-Code", code)
    h.send_header("X-Error-Message", message)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(raw)))
    h.end_headers()
    if h.command != "HEAD":
        h.wfile.write(raw)
