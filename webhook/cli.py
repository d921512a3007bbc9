"""The `dispatch-admission` command line (SPEC 7)."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import yaml

from . import __version__, api
from .core import settings as settings_mod
from .core.admission import Admission, BadReview, Enforcement, Verb
from .core.errors import Denied
from .files import RuntimeFileError, load_runtimes, load_settings

EXIT_OK, EXIT_DENIED, EXIT_UNUSABLE = 0, 1, 2


class Unusable(Exception):
    """Input or settings the command cannot work with: exit 2 with a message on stderr."""


def _now(text: str | None):
    if text is None:
        return lambda: datetime.now(timezone.utc)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise Unusable(f"--now {text!r} is not an RFC 3339 time such as 2026-11-29T12:00:00Z") from None
    if moment.tzinfo is None:
        raise Unusable(f"--now {text!r} needs a time zone (a Z or an offset)")
    return lambda: moment


def _settings(path: str):
    try:
        return load_settings(path)
    except Denied as e:
        raise Unusable(f"settings {path}: {e}") from None


def _admission(args) -> Admission:
    s = _settings(args.settings)
    try:
        runtimes = load_runtimes(args.runtime or [])
    except RuntimeFileError as e:
        raise Unusable(f"runtime {e}") from None
    return Admission(s, runtimes, clock=_now(getattr(args, "now", None)),
                     enforcement=Enforcement(getattr(args, "enforcement", "enforce")))


def cmd_review(args) -> int:
    admission = _admission(args)
    try:
        doc = json.loads(sys.stdin.buffer.read())
    except (ValueError, RecursionError) as e:
        raise Unusable(f"stdin is not a JSON AdmissionReview: {e}") from None
    try:
        verb = Verb.RUNTIMES if args.runtime_warnings else Verb.VALIDATE if args.validate else Verb.MUTATE
        response, _ = admission.review(doc, verb)
    except BadReview as e:
        raise Unusable(f"stdin is not a usable AdmissionReview: {e}") from None
    json.dump(response, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return EXIT_OK


def cmd_check(args) -> int:
    admission = _admission(args)
    denied = False
    for path in args.manifests:
        try:
            with open(path, encoding="utf-8") as f:
                docs = [d for d in yaml.safe_load_all(f) if d is not None]
        except OSError as e:
            raise Unusable(f"{path}: cannot read: {e.strerror}") from None
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise Unusable(f"{path}: not YAML: {e}") from None
        for n, doc in enumerate(docs, 1):
            if not isinstance(doc, dict) or doc.get("kind") != "TrainJob":
                print(f"# {path} document {n}: not a TrainJob, skipped", file=sys.stderr)
                continue
            name = (doc.get("metadata") or {}).get("name", "?") if isinstance(doc.get("metadata"), dict) else "?"
            result = api.check_with(admission, doc, uid=f"{path}#{n}")
            for w in result.warnings:
                print(f"warning: {path}: TrainJob {name}: {w}", file=sys.stderr)
            if not result.allowed:
                denied = True
                st = result.status
                print(f"# {path}: TrainJob {name} denied ({st['code']} {st['reason']})")
                print(st["message"])
                for cause in st["details"]["causes"]:
                    print(f"  * {cause['field']}: {cause['message']}")
            else:
                print(f"# {path}: TrainJob {name} admitted")
                print("---")
                sys.stdout.write(yaml.safe_dump(result.trainjob, sort_keys=False))
    return EXIT_DENIED if denied else EXIT_OK


def cmd_settings_check(args) -> int:
    try:
        load_settings(args.file)
    except Denied as e:
        print(str(e), file=sys.stderr)
        return EXIT_DENIED
    print(f"{args.file}: valid")
    return EXIT_OK


def cmd_settings_schema(args) -> int:
    json.dump(settings_mod.schema(), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return EXIT_OK


def cmd_audit(args) -> int:
    from . import audit

    s = _settings(args.settings)
    try:
        return audit.run(s, args.kubeconfig, args.namespace, args.output, args.page_size, sys.stdout, sys.stderr)
    except audit.ClusterUnreadable as e:
        raise Unusable(f"cannot read the cluster: {e}") from None


def cmd_certs(args) -> int:
    from . import certs

    written = certs.write_dev_pair(Path(args.out), certs.service_names(args.service, args.namespace), force=True)
    for p in written:
        print(p)
    return EXIT_OK


def cmd_serve(args) -> int:
    import os
    import tempfile

    # Before prometheus_client is first imported: workers write their metrics to files a scrape sums.
    # The directory must exist and hold nothing from an earlier run (an emptyDir survives a restart).
    metrics_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if metrics_dir:
        os.makedirs(metrics_dir, exist_ok=True)
        for stale in Path(metrics_dir).glob("*.db"):
            stale.unlink()
    else:
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="dispatch-admission-metrics-")
    from . import server

    return server.run(args)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dispatch-admission",
                                description="Admission webhook for Kubeflow Trainer TrainJobs: the dispatch publish mount.")
    p.add_argument("--version", action="version", version=f"dispatch-admission {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve /mutate, /validate and /runtimes over TLS with gunicorn")
    s.add_argument("--settings", help="settings JSON file, followed while serving (default: the embedded example"
                                      " with --dev)")
    s.add_argument("--settings-configmap", metavar="NAMESPACE/NAME",
                   help="read the settings from key settings.json of this ConfigMap and follow it through the API")
    s.add_argument("--cert-dir", help="directory with tls.crt and tls.key (default certs/ with --dev)")
    s.add_argument("--bind", default=None, help="HOST:PORT (default 127.0.0.1:8443 with --dev, else gunicorn's"
                   " configuration, else 0.0.0.0:8443)")
    s.add_argument("--metrics-bind", default=None, metavar="HOST:PORT",
                   help="serve /metrics in plain HTTP on a port of its own (and not on --bind)")
    s.add_argument("--runtime", action="append", help="runtime YAML file, instead of the Kubernetes API (repeatable)")
    s.add_argument("--kubeconfig", help="kubeconfig for the runtime watch (default: in-cluster, then KUBECONFIG)")
    s.add_argument("--workers", type=int, default=None,
                   help="gunicorn workers (default: gunicorn's configuration, else 2)")
    s.add_argument("-c", "--gunicorn-config", metavar="FILE",
                   help="a gunicorn configuration file (Python), as `gunicorn -c` reads; GUNICORN_CMD_ARGS is read too;"
                        " serve's own flags win over both")
    s.add_argument("--read-timeout", type=float, default=None, metavar="SECONDS",
                   help="a client has this long to complete the TLS handshake, and to send a whole request once it"
                        " has started (default 5)")
    s.add_argument("--enforcement", choices=["enforce", "warn"], default="enforce",
                   help="enforce denies; warn admits what enforce would deny, with warnings (SPEC 8.1)")
    s.add_argument("--client-ca", help="require client certificates signed by this CA (the API server's)")
    s.add_argument("--max-body", type=int, default=None, help="largest request body in bytes (default 7 MiB)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="info logs one line per review; warning and above only problems")
    s.add_argument("--dev", action="store_true", help="local CA and certificate under certs/, example settings")
    s.add_argument("--tls-secret", help="self-managed certificates: keep the CA and serving pair in this Secret")
    s.add_argument("--tls-service", default="dispatch-admission", help="the Service name the certificate is for")
    s.add_argument("--webhook-configuration", help="write the CA into this Mutating/ValidatingWebhookConfiguration")
    s.add_argument("--namespace", help="namespace of the Secret and Service (default: $POD_NAMESPACE)")
    s.set_defaults(func=cmd_serve)

    r = sub.add_parser("review", help="answer one AdmissionReview from stdin, as /mutate (or /validate) would")
    r.add_argument("--settings", required=True)
    r.add_argument("--runtime", action="append", required=True)
    r.add_argument("--validate", action="store_true", help="answer as /validate (default: /mutate)")
    r.add_argument("--runtime-warnings", action="store_true",
                   help="answer as /runtimes: a runtime's CREATE or UPDATE, warnings only (SPEC 8.3)")
    r.add_argument("--now", help="fix the clock (RFC 3339), for reproducible output")
    r.add_argument("--enforcement", choices=[e.value for e in Enforcement], default="enforce",
                   help="enforce denies; warn admits what enforce would deny, with warnings (SPEC 8.1)")
    r.set_defaults(func=cmd_review)

    c = sub.add_parser("check", help="mutate and validate TrainJob manifests offline")
    c.add_argument("--settings", required=True)
    c.add_argument("--runtime", action="append", required=True)
    c.add_argument("--now", help="fix the clock (RFC 3339)")
    c.add_argument("--enforcement", choices=[e.value for e in Enforcement], default="enforce",
                   help="warn: report what enforce would deny as warnings, and exit 0")
    c.add_argument("manifests", nargs="+")
    c.set_defaults(func=cmd_check)

    st = sub.add_parser("settings", help="check a settings file or print the settings JSON Schema")
    stsub = st.add_subparsers(dest="settings_command", required=True)
    sc = stsub.add_parser("check", help="exit 0 when FILE is valid settings, 1 with the ErrInvalid message")
    sc.add_argument("file")
    sc.set_defaults(func=cmd_settings_check)
    ss = stsub.add_parser("schema", help="print the JSON Schema (draft 2020-12) of the settings")
    ss.set_defaults(func=cmd_settings_schema)

    a = sub.add_parser("audit", help="judge the cluster's runtimes and TrainJobs with the webhook's rules (read only)")
    a.add_argument("--settings", required=True)
    a.add_argument("--kubeconfig", help="default: KUBECONFIG, then ~/.kube/config, then in-cluster")
    a.add_argument("--namespace", help="only TrainingRuntimes and TrainJobs of this namespace")
    a.add_argument("--output", choices=["table", "json"], default="table")
    a.add_argument("--page-size", type=int, default=500, help="objects per list call (limit/continue)")
    a.set_defaults(func=cmd_audit)

    ce = sub.add_parser("certs", help="write a CA and a serving certificate for the webhook Service")
    ce.add_argument("--service", required=True)
    ce.add_argument("--namespace", required=True)
    ce.add_argument("--out", required=True)
    ce.set_defaults(func=cmd_certs)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    try:
        args = p.parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on usage errors, which is our "unusable input" too
        return int(e.code or 0)
    try:
        return args.func(args)
    except Unusable as e:
        print(f"dispatch-admission {args.command}: {e}", file=sys.stderr)
        return EXIT_UNUSABLE
    except Denied as e:
        print(f"dispatch-admission {args.command}: {e}", file=sys.stderr)
        return EXIT_UNUSABLE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
