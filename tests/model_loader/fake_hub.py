"""A local stand-in for the Hugging Face Hub: the few routes huggingface_hub's snapshot download calls (repo info,
file tree, HEAD and GET of a file), serving model repos from local folders on 127.0.0.1."""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse


class FakeHub:
    """repos: repo id -> {revision name: local folder}; each revision gets a commit hash from its name."""

    def __init__(self, repos: dict[str, dict[str, str]], token: str | None = None):
        self.repos, self.token, self.requests = repos, token, []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def __enter__(self) -> FakeHub:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    @staticmethod
    def commit(revision: str) -> str:
        return hashlib.sha1(revision.encode()).hexdigest()

    def folder(self, repo: str, revision: str) -> str | None:
        for name, folder in self.repos.get(repo, {}).items():
            if revision in (name, self.commit(name)):
                return folder
        return None

    def files(self, folder: str) -> list[str]:
        found = []
        for root, _, names in os.walk(folder):
            found += [os.path.relpath(os.path.join(root, n), folder) for n in names]
        return sorted(found)


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _send(self, status: int, body: bytes = b"", headers: dict | None = None) -> None:
            self.send_response(status)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _route(self) -> None:
            path = unquote(urlparse(self.path).path)
            hub.requests.append((self.command, path, self.headers.get("authorization")))
            api = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)", path)
            file = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            repo, revision = (api or file).group(1, 3 if api else 2) if (api or file) else (None, None)
            if repo not in hub.repos or (hub.token and self.headers.get("authorization") != f"Bearer {hub.token}"):
                return self._send(404, b"{}", {"X-Error-Code": "RepoNotFound"})
            folder = hub.folder(repo, revision)
            if folder is None:
                return self._send(404, b"{}", {"X-Error-Code": "RevisionNotFound"})
            commit = hub.commit(next(n for n, f in hub.repos[repo].items() if f == folder))
            if api and api.group(2) == "revision":
                siblings = [{"rfilename": f} for f in hub.files(folder)]
                return self._send(200, json.dumps({"id": repo, "sha": commit, "siblings": siblings}).encode())
            if api:
                tree = [
                    {"type": "file", "path": f, "size": os.path.getsize(os.path.join(folder, f)), "oid": "0" * 40}
                    for f in hub.files(folder)
                ]
                return self._send(200, json.dumps(tree).encode())
            local = os.path.join(folder, file.group(3))
            if not os.path.isfile(local):
                return self._send(404, b"{}", {"X-Error-Code": "EntryNotFound"})
            with open(local, "rb") as f:
                body = f.read()
            etag = '"' + hashlib.sha256(body).hexdigest() + '"'
            self._send(200, body, {"X-Repo-Commit": commit, "ETag": etag})

        do_GET = do_HEAD = _route

    return Handler
