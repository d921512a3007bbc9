"""The core never imports Flask or the Kubernetes client (checked in a fresh interpreter)."""

import pkgutil
import subprocess
import sys

import webhook.core

# Every module of the core, read from the package (a module added later is checked without editing this list),
# and the CLI's parser, which must load without the adapters.
CORE = sorted(f"core.{m.name}" for m in pkgutil.iter_modules(webhook.core.__path__)) + ["cli"]
ADAPTERS = ("flask", "kubernetes", "gunicorn", "werkzeug", "urllib3", "ijson", "lmdb", "prometheus_client")


def test_the_core_list_is_read_from_the_package():
    assert {"core.settings", "core.rules", "core.verify", "core.audit", "core.reports"} <= set(CORE)


def test_core_imports_no_adapter_libraries():
    code = (
        "import sys\n"
        + "".join(f"import webhook.{m}\n" for m in CORE)
        + f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {ADAPTERS!r})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


def test_http_layer_does_not_import_the_kubernetes_adapters():
    """The worker and its connections ask the may-I-block rule of webhook.blocking, not of webhook.cluster."""
    code = (
        "import sys\n"
        "import webhook.worker, webhook.connection\n"
        "print(','.join(sorted(m for m in sys.modules if m in ('webhook.cluster', 'webhook.live_settings',"
        " 'webhook.live_reads', 'webhook.store', 'kubernetes'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""
