"""A denial as an SDK user meets it (issue 37, item 4): the Kubeflow Python SDK (PyPI `kubeflow`) submits a TrainJob
our webhook refuses, against the real API server. The SDK wraps the refusal as `RuntimeError("Failed to create
TrainJob: ...")`; our sentinel, field and rule text are on its `__cause__` (the client's ApiException), whose body
is the API server's Status with our causes. docs/debugging.md shows the two lines that print them; this test runs
those two lines."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

NS = "team-a"


@pytest.fixture(scope="module")
def sdk(env):
    from kubeflow.trainer import KubernetesBackendConfig, TrainerClient

    return TrainerClient(backend_config=KubernetesBackendConfig(namespace=NS, config_file=env.cluster.kubeconfig))


def causes_as_printed(e: BaseException) -> str:
    """What the two lines of docs/debugging.md print for an exception the SDK raised."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for cause in json.loads(e.__cause__.body)["details"]["causes"]:  # docs/debugging.md, line 1
            print(f'{cause["field"]}: {cause["message"]}')  # docs/debugging.md, line 2
    return out.getvalue()


def test_a_refused_trainjob_names_our_sentinel_field_and_rule_on_the_sdks_exception(sdk):
    from kubeflow.trainer import CustomTrainerContainer

    trainer = CustomTrainerContainer(image="pytorch", env={"DISPATCH_PUBLISH_DEST": "/tmp/elsewhere"})
    with pytest.raises(RuntimeError) as raised:
        sdk.train(runtime="torch-distributed", trainer=trainer)
    e = raised.value
    assert str(e).startswith("Failed to create TrainJob"), str(e)
    assert "ErrInvalid" not in str(e), "the SDK's own message says nothing of why: it is on __cause__"
    cause = e.__cause__
    assert cause.status == 422, cause
    status = json.loads(cause.body)
    assert status["reason"] == "Invalid"  # the API server puts `admission webhook "..." denied the request:` first
    assert "denied the request: ErrInvalid: spec.trainer.env[0].name: " in status["message"], status["message"]
    [detail] = status["details"]["causes"]
    assert detail["field"] == "spec.trainer.env[0].name"
    assert detail["message"] == ("ErrInvalid: 'DISPATCH_PUBLISH_DEST': names starting with DISPATCH_ are reserved for"
                                 " the dispatch adapter")
    printed = causes_as_printed(e)
    print("\n" + printed)
    assert printed == ("spec.trainer.env[0].name: ErrInvalid: 'DISPATCH_PUBLISH_DEST': names starting with DISPATCH_"
                       " are reserved for the dispatch adapter\n")


def test_every_reason_reaches_the_sdk_user(sdk):
    """Two rules broken at once (S3 and R7 on a torch runtime): both causes, each with its field."""
    from kubeflow.trainer import CustomTrainerContainer

    trainer = CustomTrainerContainer(image="pytorch", env={"DISPATCH_X": "1", "PET_NNODES": "4"})
    with pytest.raises(RuntimeError) as raised:
        sdk.train(runtime="torch-distributed", trainer=trainer)
    printed = causes_as_printed(raised.value).splitlines()
    assert len(printed) == 2, printed
    assert any("DISPATCH_ are reserved" in line and line.startswith("spec.trainer.env[") for line in printed), printed
    assert any("'PET_NNODES' is set by Trainer's torch plugin" in line for line in printed), printed


def test_an_admitted_trainjob_gets_the_publish_entry(sdk, env):
    from kubeflow.trainer import CustomTrainerContainer

    name = sdk.train(runtime="torch-distributed", trainer=CustomTrainerContainer(image="pytorch"))
    job = env.cluster.get("trainjob", name, NS)
    managers = [e["manager"] for e in job["spec"]["runtimePatches"]]
    assert managers[-1] == "dispatch.go.phpboyscout.uk/publish", managers
    env.cluster.kubectl("delete", "trainjob", name, "-n", NS)
