"""A denial as an SDK user meets it (issue 37, item 4): the Kubeflow Python SDK (PyPI `kubeflow` 0.5.0) submits a
TrainJob our webhook refuses, against the real API server. The SDK wraps the refusal as `RuntimeError("Failed to
create TrainJob: ...")`; our sentinel, field and rule text are on its `__cause__` (the client's ApiException), whose
body is the API server's Status with our causes. docs/debugging.md shows the two lines that print them; the script
below runs those two lines.

The SDK runs in a virtualenv of its own (made once, cached): it pins the Kubernetes client below 36, and the
webhook's own environment keeps the client its image ships."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

NS = "team-a"
SDK = "kubeflow==0.5.0"

# What a data scientist writes; the except block is docs/debugging.md's two lines.
SCRIPT = r'''
import json, sys
from kubeflow.trainer import CustomTrainerContainer, KubernetesBackendConfig, TrainerClient
client = TrainerClient(backend_config=KubernetesBackendConfig(namespace=sys.argv[2], config_file=sys.argv[1]))
env = json.loads(sys.argv[3])
try:
    name = client.train(runtime="torch-distributed", trainer=CustomTrainerContainer(image="pytorch", env=env))
    print(json.dumps({"created": name}))
except RuntimeError as e:
    print(json.dumps({"error": str(e), "status": e.__cause__.status, "body": json.loads(e.__cause__.body)}))
    for cause in json.loads(e.__cause__.body)["details"]["causes"]:
        print(f'{cause["field"]}: {cause["message"]}')
'''


@pytest.fixture(scope="module")
def sdk_python() -> str:
    from tests.e2e import toolchain

    venv = toolchain.cache_root() / f"sdk-{SDK.replace('==', '-')}"
    python = venv / "bin" / "python"
    if not (venv / ".installed").exists():
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, timeout=120)
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", SDK], check=True, timeout=600)
        (venv / ".installed").write_text(SDK)
    return str(python)


def submit(sdk_python: str, env, trainer_env: dict) -> tuple[dict, list[str]]:
    got = subprocess.run([sdk_python, "-c", SCRIPT, env.cluster.kubeconfig, NS, json.dumps(trainer_env)],
                         capture_output=True, text=True, timeout=120, cwd=Path(env.cluster.kubeconfig).parent)
    assert got.returncode == 0, got.stderr[-3000:]
    first, *printed = got.stdout.splitlines()
    return json.loads(first), printed


def test_a_refused_trainjob_names_our_sentinel_field_and_rule_on_the_sdks_exception(sdk_python, env):
    caught, printed = submit(sdk_python, env, {"DISPATCH_PUBLISH_DEST": "/tmp/elsewhere"})
    assert caught["error"].startswith("Failed to create TrainJob"), caught
    assert "ErrInvalid" not in caught["error"], "the SDK's own message says nothing of why: it is on __cause__"
    status = caught["body"]
    assert caught["status"] == 422 and status["reason"] == "Invalid", caught
    # the API server puts `admission webhook "..." denied the request:` before our message
    assert "denied the request: ErrInvalid: spec.trainer.env[0].name: " in status["message"], status["message"]
    [detail] = status["details"]["causes"]
    assert detail["field"] == "spec.trainer.env[0].name"
    assert detail["message"] == ("ErrInvalid: 'DISPATCH_PUBLISH_DEST': names starting with DISPATCH_ are reserved for"
                                 " the dispatch adapter")
    print("\n" + "\n".join(printed))
    assert printed == ["spec.trainer.env[0].name: ErrInvalid: 'DISPATCH_PUBLISH_DEST': names starting with DISPATCH_"
                       " are reserved for the dispatch adapter"]


def test_every_reason_reaches_the_sdk_user(sdk_python, env):
    """Two rules broken at once (S3, and R7 on a torch runtime): both causes, each with its field."""
    _, printed = submit(sdk_python, env, {"DISPATCH_X": "1", "PET_NNODES": "4"})
    assert len(printed) == 2, printed
    assert any("DISPATCH_ are reserved" in line and line.startswith("spec.trainer.env[") for line in printed), printed
    assert any("'PET_NNODES' is set by Trainer's torch plugin" in line for line in printed), printed


def test_an_admitted_trainjob_gets_the_publish_entry(sdk_python, env):
    caught, printed = submit(sdk_python, env, {})
    assert "created" in caught and not printed, caught
    job = env.cluster.get("trainjob", caught["created"], NS)
    managers = [e["manager"] for e in job["spec"]["runtimePatches"]]
    assert managers[-1] == "dispatch.go.phpboyscout.uk/publish", managers
    env.cluster.kubectl("delete", "trainjob", caught["created"], "-n", NS)
