"""An installed wheel, not the checkout: `serve --dev` finds the example runtimes (package data)."""

import subprocess
import sys
import zipfile

from tests.helpers import ROOT


def test_spec_7_serve_dev_finds_the_example_runtimes_in_an_installed_wheel(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
                    "--wheel-dir", str(tmp_path / "dist"), str(ROOT)], check=True, timeout=300)
    wheel = next((tmp_path / "dist").glob("dispatch_admission-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert {"webhook/examples/runtimes/torch-distributed.yaml", "webhook/examples/settings/route1.json"} <= set(names)
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    # Run from elsewhere, with the unpacked wheel first on the path: nothing of the checkout is reachable.
    code = ("import webhook.commands.serve as s; from webhook.commands.flags import parser;"
            "o = s.serve_config(parser().parse_args(['serve', '--dev'])); print(s.__file__);"
            "print(len(o.runtime_files)); print(o.runtime_files[0])")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}).stdout.split()
    assert out[0].startswith(str(site)) and int(out[1]) >= 4 and out[2].startswith(str(site / "webhook" / "examples"))
