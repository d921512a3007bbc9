import json
import time

import jsonschema
import pytest

from tests.helpers import EXAMPLES, IMAGE
from webhook.commands.files import load_settings
from webhook.core import settings as s
from webhook.core.credential_mounts import OVERLAPS_NAMED, overlapping_mounts
from webhook.core.errors import Denied, ErrInvalid

HEX = "b" * 64


def refused(doc_or_text) -> Denied:
    text = doc_or_text if isinstance(doc_or_text, str) else json.dumps(doc_or_text)
    with pytest.raises(Denied) as e:
        s.parse(text)
    assert e.value.sentinel is ErrInvalid
    assert str(e.value).startswith("ErrInvalid: ")
    return e.value


def fields(d: Denied) -> list[str]:
    return [r.field for r in d.reasons]


def test_defaults():
    got = s.parse("{}")
    assert got == s.Settings(manager=s.DEFAULT_MANAGER, publish=None, credentials=())
    assert not got.configured
    route1 = s.parse(json.dumps({"publish": {"image": IMAGE}}))
    assert route1.publish == s.Publish(image=IMAGE, via="imageVolume", init_container="dispatch-publish")
    assert route1.configured


def test_full_document():
    got = s.parse((EXAMPLES / "settings" / "route1.json").read_text())
    assert got.credentials == (s.Credential("checkpoint-store", "s3-credentials", "/var/run/dispatch/creds"),)
    r2 = s.parse((EXAMPLES / "settings" / "route2.json").read_text())
    assert r2.publish.via == "initContainer" and r2.publish.init_container == "dispatch-publish"


def test_credentials_alone_configure_the_entry():
    got = s.parse(json.dumps({"credentials": [{"name": "c", "secret": "s", "mountPath": "/c"}]}))
    assert got.publish is None and got.configured


@pytest.mark.parametrize("image", [
    f"publish:v1@sha256:{HEX}", "publish:v1", "publish", f"publish@sha256:{'b' * 63}", f"publish@sha256:{'b' * 65}",
    f"publish@sha256:{'B' * 64}", f"publish@sha512:{'b' * 128}", f"publish@sha256:{HEX}\n", "",
])
def test_image_refused(image):
    d = refused({"publish": {"image": image}})
    assert "publish.image" in fields(d)


def test_image_with_registry_port_accepted():
    assert s.parse(json.dumps({"publish": {"image": f"host:5000/path/publish@sha256:{HEX}"}})).publish


@pytest.mark.parametrize("doc,field", [
    ({"unknown": 1}, "unknown"),
    ({"publish": {"image": IMAGE, "extra": True}}, "publish.extra"),
    ({"credentials": [{"name": "a", "secret": "s", "mountPath": "/a", "x": 1}]}, "credentials[0].x"),
    ({"manager": None}, "manager"),
    ({"publish": None}, "publish"),
    ({"publish": {"image": IMAGE, "via": None}}, "publish.via"),
    ({"credentials": [None]}, "credentials[0]"),
    ({"manager": 7}, "manager"),
    ({"publish": "x"}, "publish"),
    ({"credentials": {}}, "credentials"),
    ({"publish": {"image": IMAGE, "via": "sidecar"}}, "publish.via"),
    ({"publish": {}}, "publish.image"),
    ({"publish": {"image": IMAGE, "initContainer": "dispatch-publish"}}, "publish.initContainer"),
    ({"publish": {"image": IMAGE, "via": "imageVolume", "initContainer": "x"}}, "publish.initContainer"),
    ({"publish": {"image": IMAGE, "via": "initContainer", "initContainer": "Not_A_Label"}}, "publish.initContainer"),
    ({"manager": "no-domain"}, "manager"),
    ({"manager": "Example.com/x"}, "manager"),
    ({"manager": "example.com/"}, "manager"),
    ({"credentials": [{"name": "dispatch-publish", "secret": "s", "mountPath": "/a"}]}, "credentials[0].name"),
    ({"credentials": [{"name": "UPPER", "secret": "s", "mountPath": "/a"}]}, "credentials[0].name"),
    ({"credentials": [{"name": "a", "secret": "S_bad", "mountPath": "/a"}]}, "credentials[0].secret"),
    ({"credentials": [{"name": "a", "secret": "s", "mountPath": "relative/path"}]}, "credentials[0].mountPath"),
    ({"credentials": [{"name": "a", "secret": "s"}]}, "credentials[0].mountPath"),
    ({"credentials": [{"name": "a", "secret": "s", "mountPath": "/opt/dispatch"}]}, "credentials[0].mountPath"),
    ({"credentials": [{"name": "a", "secret": "s", "mountPath": "/opt/dispatch/creds"}]}, "credentials[0].mountPath"),
    ({"credentials": [{"name": "a", "secret": "s", "mountPath": "/opt"}]}, "credentials[0].mountPath"),
    ({"credentials": [{"name": "a", "secret": "s", "mountPath": "/"}]}, "credentials[0].mountPath"),
    ({"credentials": [{"name": "a", "secret": "s", "mountPath": "//opt/./dispatch/"}]}, "credentials[0].mountPath"),
    ({"credentials": [{"name": "a", "secret": "s", "mountPath": "/x/../opt/dispatch"}]}, "credentials[0].mountPath"),
    ({"credentials": [{"name": "a", "secret": "s", "mountPath": "/c"},
                      {"name": "a", "secret": "t", "mountPath": "/d"}]},
     "credentials[1].name"),
    ({"credentials": [{"name": "a", "secret": "s", "mountPath": "/c"},
                      {"name": "b", "secret": "t", "mountPath": "/c/d"}]},
     "credentials[1].mountPath"),
    ({"credentials": [{"name": "a", "secret": "s", "mountPath": "/c/"},
                      {"name": "b", "secret": "t", "mountPath": "//c"}]},
     "credentials[1].mountPath"),
])
def test_refusals_name_the_key_path(doc, field):
    assert field in fields(refused(doc))


def cred_at(path: str) -> dict:
    return {"credentials": [{"name": "a", "secret": "s", "mountPath": path}]}


@pytest.mark.parametrize("path,plugin_path", [
    ("/etc/mpi", "/etc/mpi"), ("/etc/mpi/keys", "/etc/mpi"), ("/etc", "/etc/mpi"), ("/etc//mpi/", "/etc/mpi"),
    ("/etc/flux-config", "/etc/flux-config"), ("/curve", "/curve"), ("/mnt/flux/x", "/mnt/flux"), ("/mnt", "/mnt/flux"),
    ("/dev/shm", "/dev/shm"), ("/dev", "/dev/shm"), ("/opt/software", "/opt/software"),
    ("/var/run/secrets/kubeflow/trainer", "/var/run/secrets/kubeflow/trainer"),
    ("/var/run/secrets", "/var/run/secrets/kubeflow/trainer"), ("/var", "/var/run/secrets/kubeflow/trainer"),
])
def test_credentials_overlapping_trainers_plugin_paths_are_refused(path, plugin_path):
    """SPEC 2: Trainer's plugins mount these after the runtimePatches merge, matching mounts by path."""
    reasons = refused(cred_at(path)).reasons
    assert {r.field for r in reasons} == {"credentials[0].mountPath"}
    assert any(f"overlaps {plugin_path}," in r.text for r in reasons), reasons


@pytest.mark.parametrize("path", ["/etc/mpi-creds", "/etc/mpix", "/dev/shmem", "/var/run/dispatch/creds",
                                  "/var/run/secrets/kubeflow/other", "/mnt/fluxion", "/opt/software2", "/curved"])
def test_paths_beside_trainers_plugin_paths_are_accepted(path):
    assert s.parse(json.dumps(cred_at(path))).credentials[0].mount_path == path


@pytest.mark.parametrize("text,fragment", [
    ('{"manager": "a.io/x", "manager": "b.io/y"}', "duplicate key"),
    (f'{{"publish": {{"image": "{IMAGE}", "image": "{IMAGE}"}}}}', "duplicate key"),
    ('{"credentials": [{"name": "a", "name": "b", "secret": "s", "mountPath": "/a"}]}', "duplicate key"),
    ('{} {}', "trailing data"),
    ('{}x', "trailing data"),
    ('{"manager": NaN}', "NaN"),
    ('{"manager": Infinity}', "Infinity"),
    ('{"manager": -Infinity}', "Infinity"),
    ('{"manager": 1e999}', "NaN and Infinity"),
    ('[]', "must be a JSON object"),
    ('"publish"', "must be a JSON object"),
    ('null', "must be a JSON object"),
    ('', "Expecting value"),
    ('{"manager": "a.io/x",}', "line 1"),
    ('[' * 100000 + ']' * 100000, "nested too deeply"),
])
def test_strict_decoding(text, fragment):
    d = refused(text)
    assert fragment in str(d)


def test_duplicate_key_path_is_named_at_depth():
    d = refused('{"credentials": [{"name": "a", "secret": "s", "secret": "t", "mountPath": "/a"}]}')
    assert fields(d) == ["credentials[0].secret"]


def test_every_reason_is_listed():
    d = refused({"manager": "bad", "publish": {"image": "x:1", "initContainer": "y"}, "extra": 1})
    assert {"manager", "publish.image", "publish.initContainer", "extra"} <= set(fields(d))
    assert str(d).count("; ") >= 3


def test_invalid_utf8_is_refused():
    with pytest.raises(Denied):
        s.parse(b'{"manager": "\xff"}')


def test_schema_is_draft_2020_12_and_closed_at_every_level():
    schema = s.schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$schema"].endswith("2020-12/schema")

    def objects(node):
        if isinstance(node, dict):
            if node.get("type") == "object":
                yield node
            for v in node.values():
                yield from objects(v)
        elif isinstance(node, list):
            for v in node:
                yield from objects(v)

    found = list(objects(schema))
    assert len(found) == 3
    assert all(o["additionalProperties"] is False for o in found)


def test_schema_accepts_examples_and_refuses_a_tag():
    v = jsonschema.Draft202012Validator(s.schema())
    assert v.is_valid(json.loads((EXAMPLES / "settings" / "route1.json").read_text()))
    assert not v.is_valid({"publish": {"image": f"publish:v1@sha256:{HEX}"}})


def test_load_unreadable_file(tmp_path):
    with pytest.raises(Denied) as e:
        load_settings(str(tmp_path / "missing.json"))
    assert "cannot read" in str(e.value)


def creds(n: int, path=lambda i: f"/var/run/creds/c{i}") -> list[dict]:
    return [{"name": f"c{i}", "secret": f"secret-{i}", "mountPath": path(i)} for i in range(n)]


def test_credentials_past_the_bound_are_refused_naming_the_key():
    """The Schema bounds the list (maxItems) and the parser refuses it with the key named; at the bound, taken."""
    assert s.schema()["properties"]["credentials"]["maxItems"] == s.MAX_CREDENTIALS == 100
    assert len(s.parse(json.dumps({"credentials": creds(s.MAX_CREDENTIALS)})).credentials) == s.MAX_CREDENTIALS
    d = refused({"credentials": creds(s.MAX_CREDENTIALS + 1)})
    assert [(r.field, r.text) for r in d.reasons] == [("credentials", "must hold at most 100 items, not 101")]


def test_every_list_in_the_schema_is_bounded():
    def lists(node):
        if isinstance(node, dict):
            if node.get("type") == "array":
                yield node
            for v in node.values():
                yield from lists(v)
    found = list(lists(s.schema()))
    assert found and all(isinstance(a.get("maxItems"), int) for a in found)


@pytest.mark.timing  # a time bound: run alone, after the parallel pass (make test)
def test_five_thousand_credentials_are_checked_in_under_a_second():
    """Comparing each pair of mount paths took 15 s for 4,000 credentials: a settings file of 5,000 is refused
    for its count at once, and the overlap check itself is n log n: among 5,000 paths, every overlap is found
    (here 3, far apart), as comparing each pair would."""
    paths = {4999: "/var/run/creds/c7/deeper", 3000: "/var/run/creds/c12", 2500: "//var/run/creds/c100/"}
    mounts = [paths.get(i, f"/var/run/creds/c{i}") for i in range(5000)]
    doc = json.dumps({"credentials": creds(5000, lambda i: mounts[i])})
    started = time.perf_counter()
    d = refused(doc)
    assert [(r.field, r.text) for r in d.reasons] == [("credentials", "must hold at most 100 items, not 5000")]
    assert overlapping_mounts(mounts) == ({2500: [100], 3000: [12], 4999: [7]}, 0)
    took = time.perf_counter() - started
    assert took < 1.0, took


@pytest.mark.timing  # a time bound: run alone, after the parallel pass (make test)
def test_a_path_overlapping_thousands_is_named_a_few_times_and_counted():
    """5,000 paths at one place are 12.5 million pairs: OVERLAPS_NAMED are named and the rest counted, in
    linear time; at the bound, the reasons say so."""
    started = time.perf_counter()
    found, more = overlapping_mounts(["/same"] * 5000)
    assert time.perf_counter() - started < 1.0
    assert sum(map(len, found.values())) == OVERLAPS_NAMED and more == 5000 * 4999 // 2 - OVERLAPS_NAMED
    d = refused({"credentials": creds(s.MAX_CREDENTIALS, lambda i: "/same")})
    got = [(r.field, r.text) for r in d.reasons]
    assert got[:2] == [("credentials[1].mountPath", "'/same' overlaps credentials[0].mountPath '/same'"),
                       ("credentials[2].mountPath", "'/same' overlaps credentials[0].mountPath '/same'")]
    assert len(got) == OVERLAPS_NAMED + 1
    assert got[-1] == ("credentials", f"{100 * 99 // 2 - OVERLAPS_NAMED} more pairs of overlapping mountPaths"
                                      f" (the first {OVERLAPS_NAMED} are named)")


@pytest.mark.parametrize("mounts,pairs", [
    (["/a", "/a/b", "/c", "/a/b/c", "/ab"], [(1, 0), (3, 0), (3, 1)]),
    (["/x/y", "/x", "/x/y"], [(1, 0), (2, 0), (2, 1)]),
    (["/", "/q"], [(1, 0)]),
    (["/a/b", "/a/c", "/a/b-c", "/a/b/../c"], [(3, 1)]),
])
def test_overlaps_are_named_as_each_pair_compared_would(mounts, pairs):
    """The same reasons, in the same order, as comparing each credential with every earlier one."""
    d = refused({"credentials": creds(len(mounts), lambda i: mounts[i])})
    got = [(r.field, r.text) for r in d.reasons if "credentials[" in r.text]
    assert got == [(f"credentials[{i}].mountPath",
                    f"{mounts[i]!r} overlaps credentials[{j}].mountPath {mounts[j]!r}") for i, j in pairs]
