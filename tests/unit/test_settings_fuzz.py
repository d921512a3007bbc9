"""Settings fuzzing: any text parses to valid settings or is refused with ErrInvalid; never another exception."""

import json

from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from tests.helpers import IMAGE
from webhook.core import settings as s
from webhook.core.errors import Denied, ErrInvalid

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)

keys = st.sampled_from(["manager", "publish", "credentials", "image", "via", "initContainer", "name", "secret",
                        "mountPath", "x"])
near_valid = st.fixed_dictionaries({}, optional={
    "manager": st.one_of(st.just("example.com/m"), st.text(max_size=20), json_values),
    "publish": st.one_of(st.fixed_dictionaries({"image": st.sampled_from([IMAGE, "p:v1", IMAGE.upper(), IMAGE + "\n"])},
                                               optional={"via": st.sampled_from(["imageVolume", "initContainer", "x",
                                                                                 None]),
                                                         "initContainer": st.sampled_from(["dispatch-publish", "A",
                                                                                           ""])}),
                         json_values),
    "credentials": st.lists(st.fixed_dictionaries({}, optional={
        "name": st.sampled_from(["a", "b", "dispatch-publish", "UP", ""]),
        "secret": st.sampled_from(["s", "S!", ""]),
        "mountPath": st.sampled_from(["/a", "/a/b", "/opt", "/opt/dispatch/x", "rel", "//opt/./dispatch", "/"]),
        "extra": json_values}), max_size=3),
})


def outcome(text):
    try:
        got = s.parse(text)
    except Denied as e:
        assert e.sentinel is ErrInvalid and str(e).startswith("ErrInvalid: ")
        assert all(r.field for r in e.reasons)
        return None
    assert isinstance(got, s.Settings)
    return got


@hsettings(max_examples=400, deadline=None)
@given(st.text(max_size=200))
def test_any_text(text):
    outcome(text)


@hsettings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes(data):
    outcome(data)


@hsettings(max_examples=400, deadline=None)
@given(json_values)
def test_any_json_value(value):
    outcome(json.dumps(value, allow_nan=True))


@hsettings(max_examples=600, deadline=None)
@given(near_valid)
def test_near_valid_documents(doc):
    got = outcome(json.dumps(doc))
    if got is not None:  # what is accepted honours every rule
        assert got.publish is None or got.publish.image == IMAGE
        names = [c.name for c in got.credentials]
        assert len(names) == len(set(names)) and "dispatch-publish" not in names
