"""The benchmark's baseline: a Flask app that parses the AdmissionReview and answers `allowed`, with
no other work, served by gunicorn with exactly the webhook's worker, settings and TLS
(webhook.server.gunicorn_application). Our figures are read as ratios against it, measured in the same
run, because absolute numbers on a shared 2-core machine drift.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flask import Flask, Response, request

from webhook import certs
from webhook.server import gunicorn_application


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
    p.add_argument("--workers", type=int, default=None, help="default: gunicorn's configuration (GUNICORN_CMD_ARGS), else 2")
    args = p.parse_args()
    certfile, keyfile = str(Path(args.cert_dir) / "tls.crt"), str(Path(args.cert_dir) / "tls.key")
    tls = certs.ReloadingContext(certfile, keyfile)
    gunicorn_application(create_app, bind=args.bind, workers=args.workers, certfile=certfile, keyfile=keyfile,
                         tls=tls).run()


if __name__ == "__main__":
    main()
