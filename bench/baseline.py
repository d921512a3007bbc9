"""The benchmark's baseline: a Flask app that parses the AdmissionReview and answers `allowed`, with
no other work, served by gunicorn with exactly the webhook's settings and TLS. Our figures are read
as ratios against it, measured in the same run, because absolute numbers on a shared 2-core machine drift.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from flask import Flask, Response, request
from gunicorn.app.base import BaseApplication

from webhook import certs, gunicorn_config


def create_app() -> Flask:
    app = Flask("baseline")

    @app.post("/mutate")
    @app.post("/validate")
    def answer():
        review = json.loads(request.get_data())
        body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                "response": {"uid": review["request"]["uid"], "allowed": True}}
        return Response(json.dumps(body), mimetype="application/json")

    @app.get("/healthz")
    @app.get("/readyz")
    def ok():
        return Response("{}", mimetype="application/json")

    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bind", required=True)
    p.add_argument("--cert-dir", required=True)
    p.add_argument("--workers", type=int, default=int(os.environ.get("DISPATCH_ADMISSION_WORKERS", "2")))
    args = p.parse_args()
    certfile, keyfile = str(Path(args.cert_dir) / "tls.crt"), str(Path(args.cert_dir) / "tls.key")
    tls = certs.ReloadingContext(certfile, keyfile)

    class Server(BaseApplication):
        def load_config(self):
            for key, value in gunicorn_config.settings(args.bind, args.workers, certfile, keyfile, tls).items():
                if key != "child_exit":
                    self.cfg.set(key, value)

        def load(self):
            return create_app()

    Server().run()


if __name__ == "__main__":
    main()
