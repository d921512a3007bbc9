"""An installed wheel, not the checkout: `serve --dev` finds the example runtimes (package data)."""

import subprocess
import sys
import zipfile
from pathlib import Path

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


def test_the_wheel_installs_the_command_alone_and_check_reads_stdin(tmp_path):
    """docs/ci.md's install: the wheel `make dist` builds, in a fresh venv (uv, as `uv tool install` does), gives
    a dispatch-admission command that judges a TrainJob piped to `check -`, run from outside the checkout."""
    uv = str(Path(sys.executable).parent / "uv")
    subprocess.run([uv, "build", "--quiet", "--wheel", "--out-dir", str(tmp_path / "dist"), str(ROOT)], check=True,
                   timeout=120)
    wheel = next((tmp_path / "dist").glob("dispatch_admission-*.whl"))
    assert "webhook/commands/check_report.schema.json" in zipfile.ZipFile(wheel).namelist()
    venv = tmp_path / "venv"
    subprocess.run([uv, "venv", "--quiet", str(venv)], check=True, timeout=60)
    subprocess.run([uv, "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"), str(wheel)],
                   check=True, timeout=120)
    examples = ROOT / "webhook" / "examples"
    got = subprocess.run([str(venv / "bin" / "dispatch-admission"), "check", "--settings",
                          str(examples / "settings" / "route1.json"), "--runtime",
                          str(examples / "runtimes" / "torch-distributed.yaml"), "-"],
                         input=(examples / "trainjobs" / "admitted-torch.yaml").read_text(), capture_output=True,
                         text=True, timeout=60, cwd=tmp_path, env={"PATH": "/usr/bin:/bin"})
    assert got.returncode == 0 and got.stdout.startswith("# stdin: TrainJob train-torch admitted\n"), got.stderr
    assert str(venv) in subprocess.run([str(venv / "bin" / "python"), "-c", "import webhook; print(webhook.__file__)"],
                                       capture_output=True, text=True, cwd=tmp_path).stdout


def test_the_pre_commit_hook_names_the_console_script():
    import tomllib

    import yaml

    [hook] = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert hook["id"] == "dispatch-admission-check" and hook["language"] == "python"
    command, *args = hook["entry"].split()
    assert command in scripts and args == ["check"]
    assert scripts[command] == "webhook.commands.cli:main"
