"""The benchmark's baseline: a WSGI app that parses the AdmissionReview and answers `allowed`, with no
other work, served by gunicorn with exactly the webhook's worker, settings and TLS
(webhook.serving.application). The webhook answers its review paths before Flask's request
machinery, so the baseline does not go through Flask either: the ratio is the cost of the review itself
(rules, metrics, the log line) over the same serving path. Our figures are read as ratios against it,
measured in the same run, because absolute numbers on a shared 2-core machine drift. With `--patch FILE`
it answers every review with that JSONPatch, as bench/nullwebhook does: bench/cluster.py's Python floor for
a webhook that adds the entry.
"""

from __future__ import annotations

import argparse
import base64
from pathlib import Path

import orjson  # as the webhook reads and writes JSON: the floor is not slower than it needs to be

from webhook import certs
from webhook.serving.application import Listening, gunicorn_application

JSON = [("Content-Type", "application/json")]


def create_app(patch: bytes | None = None):
    extra = {"patchType": "JSONPatch", "patch": base64.b64encode(patch).decode()} if patch is not None else {}

    def app(environ, start_response):
        if environ["REQUEST_METHOD"] == "POST" and environ["PATH_INFO"] in ("/mutate", "/validate"):
            review = orjson.loads(environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0)))
            body = orjson.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                                 "response": {"uid": review["request"]["uid"], "allowed": True, **extra}})
        elif environ["PATH_INFO"] in ("/healthz", "/readyz"):
            body = b"{}"
        else:
            start_response("404 Not Found", JSON + [("Content-Length", "2")])
            return [b"{}"]
        start_response("200 OK", JSON + [("Content-Length", str(len(body)))])
        return [body]

    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bind", required=True)
    p.add_argument("--cert-dir", required=True)
    p.add_argument("--workers", type=int, default=None,
                   help="default: gunicorn's configuration (GUNICORN_CMD_ARGS), else 2")
    p.add_argument("--patch", help="a JSONPatch file to answer every review with (none: no patch)")
    args = p.parse_args()
    patch = Path(args.patch).read_bytes() if args.patch else None
    certfile, keyfile = str(Path(args.cert_dir) / "tls.crt"), str(Path(args.cert_dir) / "tls.key")
    tls = certs.ReloadingContext(certfile, keyfile)
    listening = Listening(certfile, keyfile, bind=args.bind, workers=args.workers)
    gunicorn_application(lambda: create_app(patch), listening, tls=tls).run()


if __name__ == "__main__":
    main()
