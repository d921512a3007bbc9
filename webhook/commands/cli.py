"""The `dispatch-admission` command line (SPEC 7)."""

from __future__ import annotations

import json
import os
import sys
from datetime import UTC, datetime
from pathlib import Path

from ..core import settings as settings_mod
from ..core.admission import Admission, BadReview, Enforcement, Verb
from ..core.errors import Denied
from .files import STDIN, InputError, RuntimeFileError, load_runtimes, read_input, read_settings, shown
from .flags import parser

EXIT_OK, EXIT_DENIED, EXIT_UNUSABLE = 0, 1, 2
EXIT_INTERRUPTED, EXIT_PIPE = 130, 141  # 128 + SIGINT, 128 + SIGPIPE: what a shell shows for either signal


class Unusable(Exception):
    """Input or settings the command cannot work with: exit 2 with a message on stderr."""


def _now(text: str | None):
    if text is None:
        return lambda: datetime.now(UTC)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise Unusable(f"--now {text!r} is not an RFC 3339 time such as 2026-11-29T12:00:00Z") from None
    if moment.tzinfo is None:
        raise Unusable(f"--now {text!r} needs a time zone (a Z or an offset)")
    return lambda: moment


def _settings(path: str):
    try:
        return read_settings(path)
    except InputError as e:
        raise Unusable(f"--settings {e}") from None
    except Denied as e:
        raise Unusable(f"settings {shown(path)}: {e}") from None


def _one_stdin(*files: str) -> None:
    """`-` is stdin, which can be read once: refuse it named twice (or where the command reads stdin itself)."""
    if files.count(STDIN) > 1:
        raise Unusable("stdin ('-') is named more than once: it can be read once")


def _admission(args, *more: str) -> Admission:
    _one_stdin(args.settings, *(args.runtime or []), *more)
    s = _settings(args.settings)
    try:
        runtimes = load_runtimes(args.runtime or [])
    except RuntimeFileError as e:
        raise Unusable(f"runtime {e}") from None
    return Admission(s, runtimes, clock=_now(getattr(args, "now", None)),
                     enforcement=Enforcement(getattr(args, "enforcement", "enforce")))


def cmd_review(args) -> int:
    admission = _admission(args, args.review)
    source = shown(args.review)
    try:
        doc = json.loads(read_input(args.review))
    except InputError as e:
        raise Unusable(str(e)) from None
    except (ValueError, RecursionError) as e:
        raise Unusable(f"{source} is not a JSON AdmissionReview: {e}") from None
    try:
        verb = Verb.RUNTIMES if args.runtime_warnings else Verb.VALIDATE if args.validate else Verb.MUTATE
        response, _ = admission.review(doc, verb)
    except BadReview as e:
        raise Unusable(f"{source} is not a usable AdmissionReview: {e}") from None
    json.dump(response, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return EXIT_OK


def cmd_check(args) -> int:
    from . import check

    admission = _admission(args, *args.manifests)
    documents = []
    for path in args.manifests:
        try:
            documents += check.judge(admission, path)
        except InputError as e:
            raise Unusable(str(e)) from None
    code, why = check.outcome(documents)
    if args.output == "json":
        check.write_json(documents, args.enforcement, sys.stdout)
    elif args.output == "junit":
        sys.stdout.write(check.junit(documents))
    else:
        check.write_text(documents, sys.stdout, sys.stderr)
    if why:
        print(f"dispatch-admission check: {why}", file=sys.stderr)
    return code


def cmd_settings_check(args) -> int:
    try:
        read_settings(args.file)
    except InputError as e:
        raise Unusable(str(e)) from None
    except Denied as e:  # SPEC 7: invalid settings exit 1, with the ErrInvalid message
        print(str(e), file=sys.stderr)
        return EXIT_DENIED
    print(f"{shown(args.file)}: valid")
    return EXIT_OK


def cmd_settings_schema(args) -> int:
    json.dump(settings_mod.schema(), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return EXIT_OK


def _kubeconfig(path: str | None) -> None:
    """A --kubeconfig that is not there, named as such before any call (the client says only "Invalid kube-config
    file. No configuration found.")."""
    if path is not None and not os.path.isfile(path):
        raise Unusable(f"--kubeconfig {path}: " + ("is not a file" if os.path.exists(path) else "no such file"))


def cmd_audit(args) -> int:
    from . import audit

    _kubeconfig(args.kubeconfig)
    s = _settings(args.settings)
    try:
        code = audit.run(s, args.kubeconfig, args.namespace, args.output, args.page_size, sys.stdout, sys.stderr,
                         report=args.report)
    except audit.ClusterUnreadable as e:
        raise Unusable(f"cannot read the cluster: {e}") from None
    return EXIT_OK if args.exit_zero and code == 1 else code


def cmd_verify(args) -> int:
    from . import verify

    if args.cleanup:
        return _verify_cleanup(args)
    if args.all_namespaces:
        raise Unusable("--all-namespaces goes with --cleanup only (the probes of one run go in one namespace)")
    if not args.runtime:
        raise Unusable("--runtime KIND/NAME is required (or --cleanup, to remove the probes earlier runs left)")
    _kubeconfig(args.kubeconfig)
    s = _settings(args.settings) if args.settings else None
    try:
        opts = verify.Options(
            runtime=args.runtime, namespace=args.namespace, kubeconfig=args.kubeconfig, settings=s,
            per_node=args.per_node, image=args.image, command=args.probe_command or list(verify.DEFAULT_COMMAND),
            labels=verify.parse_labels(args.label or []), timeout=args.timeout, keep=args.keep, output=args.output,
            max_probes=args.max_probes)
        verify.check_arguments(opts)
        return verify.run(opts, sys.stdout, sys.stderr)
    except verify.Unusable as e:
        raise Unusable(str(e)) from None


def _verify_cleanup(args) -> int:
    from . import verify, verify_cleanup

    if args.runtime:
        raise Unusable("--cleanup makes no probe: leave out --runtime")
    if args.all_namespaces and args.namespace:
        raise Unusable("--cleanup: --namespace or --all-namespaces, not both")
    _kubeconfig(args.kubeconfig)
    opts = verify_cleanup.Options(namespace=args.namespace, all_namespaces=args.all_namespaces,
                                  kubeconfig=args.kubeconfig, output=args.output)
    try:
        return verify_cleanup.run(opts, sys.stdout)
    except verify.Unusable as e:
        raise Unusable(str(e)) from None


def cmd_certs(args) -> int:
    from .. import certs

    try:
        written = certs.write_dev_pair(Path(args.out), certs.service_names(args.service, args.namespace), force=True)
    except OSError as e:
        raise Unusable(f"--out {args.out}: cannot write: {(e.strerror or str(e)).lower()}") from None
    for p in written:
        print(p)
    return EXIT_OK


def cmd_certificates(args) -> int:
    import logging
    import os

    from .. import certs
    from ..kube.client import api_client
    from ..process.stopping import stopped_by_signals

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    # Without it, every uninstall and every rollout of the (Recreate) Deployment waited the pod's 30 s grace.
    stopped = stopped_by_signals()
    namespace = args.namespace or os.environ.get("POD_NAMESPACE") or "default"
    controller = certs.CertificateController(api_client(args.kubeconfig), namespace, args.tls_secret,
                                             certs.service_names(args.tls_service, namespace),
                                             args.webhook_configuration, args.ca_secret)
    while not stopped.is_set():
        try:
            controller.sync()
        except Exception as e:  # the API refused or cannot be reached: the pods keep serving, try again
            if args.once:
                raise Unusable(f"{type(e).__name__}: {str(e)[:500]}") from None
            print(json.dumps({"msg": "certificate sync failed", "error": str(e)[:300]}), file=sys.stderr)
        if args.once:
            return EXIT_OK
        stopped.wait(args.every)
    print(json.dumps({"msg": "certificate controller stopped"}), file=sys.stderr)
    return EXIT_OK


WILDCARDS = ("", "0.0.0.0", "::", "*")
LOOPBACK = ("localhost", "127.0.0.1")


def _one_listener(a: str, b: str) -> bool:
    """Do two HOST:PORT binds name one listener (the same port, and the same host or a wildcard)?"""
    (host_a, _, port_a), (host_b, _, port_b) = a.rpartition(":"), b.rpartition(":")
    host_a, host_b = host_a.strip("[]"), host_b.strip("[]")
    return port_a == port_b and (host_a == host_b or host_a in WILDCARDS or host_b in WILDCARDS
                                 or (host_a in LOOPBACK and host_b in LOOPBACK))


def cmd_serve(args) -> int:
    import logging

    from ..process import metrics
    from . import serve

    bind = args.bind or (serve.DEV_BIND if args.dev else None)
    if not bind and not args.gunicorn_config and "GUNICORN_CMD_ARGS" not in os.environ:
        from ..serving.gunicorn_config import DEFAULTS

        bind = DEFAULTS["bind"][0]
    if args.metrics_bind and bind and _one_listener(args.metrics_bind, bind):
        given = "--bind" if args.bind else "--bind's default"
        raise Unusable(f"--metrics-bind {args.metrics_bind} is the port {given} serves ({bind}): the metrics need a"
                       " port of their own")
    files = args.runtime or (args.dev and not args.kubeconfig)  # --dev's example runtimes
    if args.runtime_keeper == "external" and not args.runtime_store and not files:
        raise Unusable("--runtime-keeper external needs --runtime-store, the directory the other container keeps")
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr, format="%(message)s")
    metrics.start()  # in the master, before the workers fork: the families in multiprocess mode
    try:
        return serve.run(serve.serve_config(args))
    except Denied as e:  # settings, certificate or runtime files that cannot be served
        print(f"dispatch-admission serve: {e}", file=sys.stderr)
        return EXIT_DENIED


def cmd_keep(args) -> int:
    import logging

    from ..kube import keeper

    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr, format="%(message)s")
    return keeper.run(args.runtime_store, args.kubeconfig, rate=args.live_reads_per_second,
                      burst=args.live_reads_burst, fresh=args.fresh, parent=args.parent,
                      namespace_share=args.namespace_share)


HANDLERS = {"serve": cmd_serve, "keep": cmd_keep, "certificates": cmd_certificates, "review": cmd_review,
            "check": cmd_check, "settings_check": cmd_settings_check, "settings_schema": cmd_settings_schema,
            "audit": cmd_audit, "verify": cmd_verify, "certs": cmd_certs}


def main(argv: list[str] | None = None) -> int:
    try:
        return _run(argv)
    except BrokenPipeError:
        # The reader went away (`settings schema | head`): stop quietly, as a command SIGPIPE stops. Python
        # flushes stdout again at exit, which would fail the same way: point it at /dev/null first.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE


def _run(argv: list[str] | None) -> int:
    p = parser()
    try:
        args = p.parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on usage errors, which is our "unusable input" too
        sys.stdout.flush()  # --help: a closed pipe shows here, inside main
        return int(e.code or 0)
    try:
        code = HANDLERS[args.handler](args)
        sys.stdout.flush()
        return code
    except Unusable as e:
        print(f"dispatch-admission {args.command}: {e}", file=sys.stderr)
        return EXIT_UNUSABLE
    except Denied as e:
        print(f"dispatch-admission {args.command}: {e}", file=sys.stderr)
        return EXIT_UNUSABLE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
