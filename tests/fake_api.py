"""Fake API servers: `FakeAPI` for `serve --metrics-auth` (webhook.kube.metrics_auth), TokenReview and
SubjectAccessReview only, in plain HTTP on loopback, for the real kubernetes client; `Script`, recorded list
answers and watch streams for a `webhook.kube.reflector.Reflector`."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

USERS = {"prometheus": True, "nosy": False}  # token (the user's name) -> may get /metrics


class FakeAPI:
    """TokenReview: a token named in USERS is that user; SubjectAccessReview: USERS says. `gate`, when
    cleared, holds every answer; `delay` slows them."""

    def __init__(self):
        self.calls: list[str] = []
        self.gate, self.delay = threading.Event(), 0.0
        self.gate.set()
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                kind = "TokenReview" if self.path.endswith("/tokenreviews") else "SubjectAccessReview"
                api.calls.append(kind)
                api.gate.wait(10)
                time.sleep(api.delay)
                if kind == "TokenReview":
                    token = body["spec"]["token"]
                    status = {"authenticated": True, "user": {"username": token}} if token in USERS else {}
                else:
                    status = {"allowed": USERS[body["spec"]["user"]]}
                out = json.dumps({**body, "status": status}).encode()
                self.send_response(201)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                try:
                    self.end_headers()
                    self.wfile.write(out)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # a client whose time ran out while the gate or the delay held its answer: what tests want

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def client(self):
        from kubernetes import client

        configuration = client.Configuration()
        configuration.host = f"http://127.0.0.1:{self.server.server_address[1]}"
        return client.ApiClient(configuration)

    def reviews(self) -> int:
        return self.calls.count("TokenReview")

    def kubeconfig(self, path: Path) -> str:
        """A kubeconfig naming this server, no credentials."""
        host = f"http://127.0.0.1:{self.server.server_address[1]}"
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": host}}],
            "users": [{"name": "fake", "user": {}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}]}))
        return str(path)

    def stop(self) -> None:
        self.gate.set()
        self.server.shutdown()


class Script:
    """Plays recorded list answers and watch streams in order, recording what was asked."""

    def __init__(self, lists, watches):
        self.lists, self.watches, self.calls, self.sleeps = list(lists), list(watches), [], []

    def list(self, kind):
        self.calls.append(("list",))
        answer = self.lists.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def watch(self, kind, version):
        self.calls.append(("watch", version))
        stream = self.watches.pop(0) if self.watches else StopReflector()
        if isinstance(stream, Exception):
            raise stream
        yield from stream


class StopReflector(Exception):
    pass
