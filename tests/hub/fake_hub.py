"""A local HTTP server that answers the Hub endpoints huggingface_hub calls (``HF_ENDPOINT``):
the model API (``/api/models/{repo}/revision/{rev}?blobs=true``) and file resolution
(``HEAD``/``GET /{repo}/resolve/{rev}/{path}``, with ``Range``), serving folders as
repositories, with the Hub's error headers for gated repositories and missing revisions,
and faults to inject (a truncated file, a wrong sha256, a connection dropped mid-file).
Every request is logged, so tests assert what was fetched."""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

LFS_MIN = 1024  # files of at least this size (and every weight file) are LFS files, as on the Hub
WEIGHTS = (".safetensors", ".bin", ".pth", ".pt", ".gguf", ".onnx")


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str
    gated: bool = False
    branches: dict[str, str] = field(default_factory=dict)
    lies: dict[str, str] = field(default_factory=dict)  # path -> the sha256 the API claims
    short: dict[str, int] = field(default_factory=dict)  # path -> bytes actually served (a truncated file)
    drop_after: dict[str, int] = field(default_factory=dict)  # path -> bytes sent before the first GET drops

    def lfs(self, path: str) -> bool:
        return path.endswith(WEIGHTS) or len(self.files[path]) >= LFS_MIN


@dataclass
class Request:
    method: str
    path: str
    range: str | None


class FakeHub:
    """Serve repositories on 127.0.0.1; ``url`` is what HF_ENDPOINT is set to."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.log: list[Request] = []
        self.ignore_range = False  # answer 200 with the whole file to a Range request, as some proxies do
        self.fail_api: int | None = None  # answer the model API with this status (a 5xx)
        self.fail_files: dict[str, int] = {}  # path -> the status every request for that file gets
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                hub.answer(self, head=False)

            def do_HEAD(self) -> None:
                hub.answer(self, head=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def add(self, repo_id: str, files: dict[str, bytes], **kw: object) -> Repo:
        commit = hashlib.sha1(repo_id.encode() + "".join(sorted(files)).encode()).hexdigest()
        repo = Repo(dict(files), commit, **kw)  # type: ignore[arg-type]
        repo.branches.setdefault("main", commit)
        self.repos[repo_id] = repo
        return repo

    def add_folder(self, repo_id: str, folders: dict[str, Path], **kw: object) -> Repo:
        """A repository of local folders, each at a path inside it ("" for the root)."""
        files = {}
        for where, folder in folders.items():
            for p in sorted(folder.rglob("*")):
                if p.is_file():
                    files[(f"{where}/" if where else "") + p.relative_to(folder).as_posix()] = p.read_bytes()
        return self.add(repo_id, files, **kw)

    def fetched(self, method: str = "GET") -> list[str]:
        """The file paths requested with ``method`` (``org/name/resolve/rev/`` removed)."""
        out = []
        for r in self.log:
            m = re.match(r"^/[^/]+/[^/]+/resolve/[^/]+/(.+)$", r.path)
            if m and r.method == method:
                out.append(m.group(1))
        return out

    # --- answers ---------------------------------------------------------------------

    def answer(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        url = urlparse(h.path)
        path = unquote(url.path)
        self.log.append(Request(h.command, path, h.headers.get("Range")))
        if m := re.match(r"^/api/models/([^/]+/[^/]+?)(?:/revision/([^/]+))?/?$", path):
            if self.fail_api is not None:
                return self._error(h, self.fail_api, "", "the Hub is down")
            return self._model_info(h, m.group(1), m.group(2) or "main")
        if m := re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path):
            return self._resolve(h, m.group(1), m.group(2), m.group(3), head)
        self._error(h, 404, "EntryNotFound", "no such endpoint")

    def _error(self, h: BaseHTTPRequestHandler, status: int, code: str, message: str, commit: str = "") -> None:
        body = json.dumps({"error": message}).encode()
        h.send_response(status)
        h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        if commit:
            h.send_header("X-Repo-Commit", commit)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(body)

    def _repo(self, h: BaseHTTPRequestHandler, repo_id: str, rev: str) -> tuple[Repo, str] | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            self._error(h, 401, "RepoNotFound", "Repository not found")
            return None
        commit = repo.branches.get(rev) or (rev if rev == repo.commit else None)
        if commit is None:
            self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}")
            return None
        return repo, commit

    def _model_info(self, h: BaseHTTPRequestHandler, repo_id: str, rev: str) -> None:
        found = self._repo(h, repo_id, rev)
        if found is None:
            return
        repo, commit = found
        siblings = []
        for name, data in sorted(repo.files.items()):
            entry: dict[str, object] = {"rfilename": name, "size": len(data), "blobId": _git_blob(data)}
            if repo.lfs(name):
                sha = repo.lies.get(name) or hashlib.sha256(data).hexdigest()
                entry["lfs"] = {"sha256": sha, "size": len(data), "pointerSize": 134}
            siblings.append(entry)
        body = json.dumps(
            {
                "id": repo_id,
                "modelId": repo_id,
                "sha": commit,
                "private": False,
                "gated": "manual" if repo.gated else False,
                "siblings": siblings,
            }
        ).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _resolve(self, h: BaseHTTPRequestHandler, repo_id: str, rev: str, name: str, head: bool) -> None:
        found = self._repo(h, repo_id, rev)
        if found is None:
            return
        repo, commit = found
        if repo.gated:
            return self._error(h, 403, "GatedRepo", f"Access to model {repo_id} is restricted.", commit)
        if name in self.fail_files:
            return self._error(h, self.fail_files[name], "", "the Hub is down", commit)
        if name not in repo.files:
            return self._error(h, 404, "EntryNotFound", f"{name} does not exist", commit)
        data = repo.files[name]
        etag = hashlib.sha256(data).hexdigest() if repo.lfs(name) else _git_blob(data)
        served = data[: repo.short[name]] if name in repo.short else data
        start, end, status = 0, len(served) - 1, 200
        if not self.ignore_range and (rng := h.headers.get("Range")) and (m := re.match(r"bytes=(\d+)-(\d*)$", rng)):
            start = int(m.group(1))
            end = min(int(m.group(2)) if m.group(2) else len(served) - 1, len(served) - 1)
            status = 206
        chunk = served[start : end + 1]
        h.send_response(status)
        h.send_header("X-Repo-Commit", commit)
        h.send_header("ETag", f'"{etag}"')
        if repo.lfs(name):
            h.send_header("X-Linked-Etag", f'"{etag}"')
            h.send_header("X-Linked-Size", str(len(data)))
        h.send_header("Accept-Ranges", "bytes")
        if status == 206:
            h.send_header("Content-Range", f"bytes {start}-{end}/{len(served)}")
        h.send_header("Content-Length", str(len(chunk) if not head else len(served)))
        h.end_headers()
        if head:
            return
        if name in repo.drop_after:  # the first GET of this file ends early: the connection drops
            cut = repo.drop_after.pop(name)
            h.wfile.write(chunk[:cut])
            h.wfile.flush()
            h.close_connection = True
            h.connection.shutdown(2)
            return
        h.wfile.write(chunk)


def _git_blob(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """The fake Hub as huggingface_hub's endpoint, with an empty cache (a test module imports it:
    a conftest.py here would shadow tests/conftest.py, since every tests/ folder is on sys.path)."""
    server = FakeHub()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.chdir(tmp_path)  # no local org/name here: names go to the Hub
    yield server
    server.close()
