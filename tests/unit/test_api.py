"""The Python API a submitter uses to check a TrainJob before sending it (webhook.api)."""

import json

import pytest

from tests.helpers import IMAGE, MANAGER, NOW, ROUTE1, ROUTE2, mount_patch, review, runtime, stock_runtimes, trainjob
from webhook import api

TORCH = stock_runtimes().get("ClusterTrainingRuntime", "", "torch-distributed")


def test_parse_settings_takes_text_bytes_or_a_mapping_and_refuses_with_a_sentinel():
    for raw in (json.dumps(ROUTE1), json.dumps(ROUTE1).encode(), ROUTE1):
        assert api.parse_settings(raw).publish.image == IMAGE
    with pytest.raises(api.Denied) as e:
        api.parse_settings({"publish": {"image": "publish:v1"}})
    assert e.value.sentinel is api.Sentinel.ErrInvalid and e.value.sentinel.code == 422
    assert [r.field for r in e.value.reasons] == ["publish.image"]


def test_settings_schema_is_a_copy():
    schema = api.settings_schema()
    schema["properties"].clear()
    assert api.settings_schema()["properties"]


def test_capabilities_names_what_stops_a_runtime():
    settings = api.parse_settings(ROUTE2)
    assert api.capabilities(settings, stock_runtimes().get("ClusterTrainingRuntime", "", "torch-init")) == []
    found = api.capabilities(settings, TORCH)
    assert [(r.sentinel, r.rule) for r in found] == [(api.Sentinel.ErrUnsupported, "R4")]


def test_check_mutates_then_validates_as_the_api_server_would():
    settings = api.parse_settings({**ROUTE1})
    job = trainjob()
    got = api.check(settings, job, [TORCH], now=NOW)
    assert got.allowed and got.status is None and got.reasons == ()
    assert [e["manager"] for e in got.trainjob["spec"]["runtimePatches"]] == [MANAGER]
    assert got.trainjob["spec"]["runtimePatches"][0]["time"] == "2026-11-29T12:00:00Z"
    assert "runtimePatches" not in job["spec"], "the caller's object is not changed"
    refused = api.check(settings, trainjob(patches=[mount_patch("/opt/dispatch")]), [TORCH])
    assert not refused.allowed and refused.trainjob is None and refused.status["code"] == 422
    assert [r.rule for r in refused.reasons] == ["S2"]


def test_review_answers_any_path_in_either_mode():
    settings = api.parse_settings(ROUTE2)
    rt = runtime("no-init")
    doc = review(trainjob(runtime_name="no-init"))
    assert api.review(settings, [rt], doc, "mutate")["response"]["status"]["code"] == 403
    warned = api.review(settings, [rt], doc, "validate", enforcement="warn")["response"]
    assert warned["allowed"] and any(w.startswith("would deny: ErrUnsupported") for w in warned["warnings"])
    runtime_doc = review(rt, resource="clustertrainingruntimes")
    assert api.review(settings, [], runtime_doc, "runtimes")["response"]["warnings"][0].startswith("R4: ")
