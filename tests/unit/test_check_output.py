"""`check --output json` against the JSON Schema the package ships, `--output junit` against a JUnit XSD."""

import json
from importlib import resources
from xml.etree import ElementTree as ET

import jsonschema
import pytest
import xmlschema

from tests.helpers import EXAMPLES, NOW_TEXT, ROOT
from tests.unit.test_cli import ROUTE1, ROUTE2, cli, runtime_args

JUNIT_XSD = xmlschema.XMLSchema(str(ROOT / "tests" / "unit" / "data" / "junit.xsd"))
SCHEMA = json.loads(resources.files("webhook.commands").joinpath("check_report.schema.json").read_text())
TRAINJOBS = sorted(str(p) for p in (EXAMPLES / "trainjobs").glob("*.yaml") if "route2" not in p.name)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """Every example TrainJob of route 1, one of another apiVersion, and a Deployment, in one more file."""
    extra = tmp_path_factory.mktemp("check") / "mixed.yaml"
    torch = (EXAMPLES / "trainjobs" / "admitted-torch.yaml").read_text()
    extra.write_text(torch.replace("v1alpha1", "v1").replace("train-torch", "old-torch") + "---\n"
                     "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: web}\n---\n")
    return [*TRAINJOBS, str(extra)]


def run(output, manifests, *flags):
    return cli("check", "--settings", ROUTE1, *runtime_args(), "--now", NOW_TEXT, "--output", output, *flags,
               *manifests)


def test_the_schema_is_a_valid_json_schema():
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    assert SCHEMA["properties"]["apiVersion"]["const"] == "dispatch-admission/check/v1"


@pytest.mark.parametrize("enforcement", ["enforce", "warn"])
def test_json_output_validates_and_says_every_verdict(mixed, enforcement):
    got = run("json", mixed, "--enforcement", enforcement)
    report = json.loads(got.stdout)
    jsonschema.validate(report, SCHEMA)
    assert got.returncode == report["exitCode"] == 2 and report["error"].endswith("TrainJob old-torch"
                                                                                  f" ({mixed[-1]} document 1)")
    by_name = {d["name"]: d for d in report["documents"]}
    assert by_name["old-torch"]["verdict"] == "not-served" and by_name["web"]["verdict"] == "skipped"
    assert by_name["train-torch"]["verdict"] == "admitted" and by_name["train-torch"]["trainjob"]["spec"]
    if enforcement == "warn":
        assert report["summary"]["denied"] == 0 and by_name["refused-env"]["warnings"]
        return
    refused = by_name["refused-env"]
    assert refused["verdict"] == "denied" and refused["code"] == 422
    assert refused["reasons"] == [{"sentinel": "ErrInvalid", "code": 422, "field": "spec.trainer.env[0].name",
                                   "rule": "S3", "message": "'DISPATCH_PUBLISH_DEST': names starting with DISPATCH_"
                                                            " are reserved for the dispatch adapter"}]
    denied = [d for d in report["documents"] if d["verdict"] == "denied"]
    assert report["summary"] == {"admitted": 3, "denied": len(denied), "not-served": 1, "skipped": 1}
    assert len(denied) == len([p for p in TRAINJOBS if "/refused-" in p])
    assert {r["rule"] for d in denied for r in d["reasons"]} >= {"S1", "S2", "S3", "R1", "R2", "R3", "R5", "R6", "R7"}


def test_json_output_of_a_run_that_judged_everything_exits_as_it_says():
    got = run("json", [str(EXAMPLES / "trainjobs" / "admitted-torch.yaml")])
    report = json.loads(got.stdout)
    jsonschema.validate(report, SCHEMA)
    assert got.returncode == report["exitCode"] == 0 and report["error"] is None and got.stderr == ""


def test_junit_output_validates_a_testcase_per_trainjob_a_failure_per_denial(mixed):
    got = run("junit", mixed)
    JUNIT_XSD.validate(got.stdout)
    root = ET.fromstring(got.stdout)
    cases = root.findall("testsuite/testcase")
    refused = [p for p in TRAINJOBS if "/refused-" in p]
    assert len(cases) == len(TRAINJOBS) + 1, "one testcase per TrainJob; the Deployment is none"
    assert len(root.findall("testsuite/testcase/failure")) == len(refused) == int(root.get("failures"))
    [error] = root.findall("testsuite/testcase/error")
    assert error.get("type") == "NotServed" and "trainer.kubeflow.org/v1 is not served" in error.get("message")
    env = next(c for c in cases if c.get("name") == "TrainJob team-a/refused-env (document 1)")
    assert env.find("failure").get("type") == "ErrInvalid" and "DISPATCH_PUBLISH_DEST" in env.find("failure").text
    assert got.returncode == 2


def test_junit_of_route2_and_warnings_validates():
    got = cli("check", "--settings", ROUTE2, *runtime_args(), "--enforcement", "warn", "--output", "junit",
              *(str(p) for p in (EXAMPLES / "trainjobs").glob("*.yaml")))
    JUNIT_XSD.validate(got.stdout)
    assert ET.fromstring(got.stdout).findall("testsuite/testcase/system-out") and got.returncode == 0


def test_junit_xsd_refuses_what_ci_systems_cannot_read():
    """The XSD does check: a testcase without a name, or a failure after system-out, is refused."""
    assert not JUNIT_XSD.is_valid('<testsuites><testsuite name="a" tests="1"><testcase/></testsuite></testsuites>')
    assert not JUNIT_XSD.is_valid('<testsuites><testsuite name="a" tests="1"><testcase name="x"><system-out/>'
                                  '<failure/></testcase></testsuite></testsuites>')


@pytest.mark.parametrize("output", ["json", "junit"])
def test_the_outputs_docs_cli_md_shows_are_the_programs(output):
    """docs/cli.md shows each output of one run: the page holds what the program prints, byte for byte."""
    import re

    page = (ROOT / "docs" / "cli.md").read_text()
    [shown] = re.findall(rf"--output {output} examples/trainjobs/refused-s3-dispatch-env.yaml\n(.*?)```", page, re.S)
    got = cli("check", "--settings", ROUTE1, "--runtime", str(EXAMPLES / "runtimes" / "torch-distributed.yaml"),
              "--output", output, "examples/trainjobs/refused-s3-dispatch-env.yaml", cwd=ROOT)
    assert got.stdout == shown
    if output == "json":
        jsonschema.validate(json.loads(shown), SCHEMA)
    else:
        JUNIT_XSD.validate(shown)
