"""There is no Docker engine here: the Dockerfile's properties are checked by reading it."""

import re

from tests.helpers import ROOT

TEXT = (ROOT / "Dockerfile").read_text()
STAGES = re.split(r"^FROM ", TEXT, flags=re.M)[1:]


def test_multi_stage_with_a_base_pinned_by_digest():
    assert len(STAGES) == 2
    base = re.search(r"^ARG PYTHON_BASE=(\S+)$", TEXT, re.M).group(1)
    assert re.fullmatch(r"python:3\.1\d-slim[\w.-]*@sha256:[0-9a-f]{64}", base)
    assert all(s.startswith("${PYTHON_BASE}") for s in STAGES)


def test_final_stage_installs_the_wheel_only_and_has_no_build_tools():
    final = STAGES[-1]
    assert "COPY --from=build /wheels" in final and "--no-index" in final
    assert "pip uninstall -y pip setuptools wheel" in final
    assert not re.search(r"apt-get|gcc|build-essential|COPY webhook", final)


def test_runs_as_a_numeric_non_root_user():
    users = re.findall(r"^USER (\S+)$", STAGES[-1], re.M)
    assert users and re.fullmatch(r"[1-9]\d*:[1-9]\d*", users[-1])


def test_entrypoint_is_the_serve_command():
    assert re.search(r'^ENTRYPOINT \["dispatch-admission"\]$', TEXT, re.M)
    assert re.search(r'^CMD \["serve"', TEXT, re.M)


def test_chart_runs_the_image_as_the_same_user():
    values = (ROOT / "charts" / "dispatch-admission" / "templates" / "deployment.yaml").read_text()
    uid = re.findall(r"^USER (\d+):", STAGES[-1], re.M)[-1]
    assert f"runAsUser: {uid}" in values
