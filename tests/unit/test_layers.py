"""The core never imports Flask or the Kubernetes client (checked in a fresh interpreter)."""

import subprocess
import sys

CORE = ["core." + m for m in ("settings", "paths", "images", "errors", "rules", "patch", "runtimes", "admission")] + ["cli"]


def test_core_imports_no_adapter_libraries():
    code = (
        "import sys\n"
        + "".join(f"import webhook.{m}\n" for m in CORE)
        + "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('flask', 'kubernetes', 'gunicorn', 'werkzeug'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""
