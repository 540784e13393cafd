"""A HuggingFace hub on loopback, enough of its HTTP API for huggingface_hub's snapshot_download
and list_repo_files (repo info by revision, the recursive tree, HEAD and GET of /resolve/), serving
one repository whose revisions are given as {revision: {path: bytes}}. Each revision's commit is
the digest of its files; `main` and tags name theirs. Every request is counted, per path. With
`unavailable` set, every request is answered 503 (the hub overloaded or down for a while)."""

from __future__ import annotations

import collections
import hashlib
import http.server
import json
import socket
import threading
import urllib.parse


class FakeHub:
    def __init__(self, repo: str, revisions: dict[str, dict[str, bytes]]):
        self.repo = repo
        self.files = {}  # commit → {path: bytes}
        self.refs = {}  # revision (branch, tag, or the commit itself) → commit
        for name, files in revisions.items():
            commit = hashlib.sha1(json.dumps(sorted((p, hashlib.sha1(b).hexdigest()) for p, b in files.items()))
                                  .encode()).hexdigest()
            self.files[commit] = files
            self.refs[name] = self.refs[commit] = commit
        self.requests: collections.Counter = collections.Counter()
        self.unavailable = False
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, status: int, body: bytes = b"", headers: dict | None = None, send_body: bool = True):
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if send_body:
                    self.wfile.write(body)

            def _route(self, send_body: bool):
                path = urllib.parse.urlparse(self.path).path
                hub.requests[path] += 1
                if hub.unavailable:
                    return self._answer(503, b'{"error": "Service Unavailable"}', {"Content-Type": "application/json"},
                                        send_body)
                api = f"/api/models/{hub.repo}/"
                if path.startswith(api + "revision/"):
                    commit = hub.refs.get(urllib.parse.unquote(path[len(api + "revision/"):]))
                    if commit is None:
                        return self._answer(404, b'{"error": "Revision Not Found"}',
                                            {"X-Error-Code": "RevisionNotFound", "Content-Type": "application/json"})
                    body = {"id": hub.repo, "sha": commit, "siblings": [{"rfilename": p} for p in hub.files[commit]]}
                    return self._answer(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, send_body)
                if path.startswith(api + "tree/"):
                    commit = hub.refs.get(urllib.parse.unquote(path[len(api + "tree/"):]))
                    if commit is None:
                        return self._answer(404, b'{"error": "Revision Not Found"}',
                                            {"X-Error-Code": "RevisionNotFound", "Content-Type": "application/json"})
                    body = [{"type": "file", "path": p, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                            for p, b in hub.files[commit].items()]
                    return self._answer(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, send_body)
                prefix = f"/{hub.repo}/resolve/"
                if path.startswith(prefix):
                    revision, _, file = path[len(prefix):].partition("/")
                    commit = hub.refs.get(urllib.parse.unquote(revision))
                    data = hub.files.get(commit, {}).get(urllib.parse.unquote(file))
                    if data is None:
                        return self._answer(404, b"", {"X-Error-Code": "EntryNotFound"})
                    return self._answer(200, data, {"X-Repo-Commit": commit,
                                                    "ETag": f'"{hashlib.sha1(data).hexdigest()}"'}, send_body)
                return self._answer(404)

            def do_GET(self):
                self._route(True)

            def do_HEAD(self):
                self._route(False)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class SilentPort:
    """A port that accepts connections and never answers: a hub that is there but unreachable in
    practice. Any client that calls it hangs until its own timeout; `accepted` counts who tried."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.held:
            c.close()
