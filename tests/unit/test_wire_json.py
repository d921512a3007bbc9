"""The server reads and writes review JSON with orjson (issue 15): checked here against the standard
library, which stays the judge. What the server decodes must be the value json.loads gives (types
included: True is not 1, 1.0 is not 1), what json.loads refuses must still be refused with its message
(but nesting between its limit, a little under 1,000 levels, and orjson's 1,024, which is read and left
to the rules: tests/server/test_hostile.py), and what the server writes must read back, with the
standard library, as the value it encoded."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import admission, review, trainjob
from tests.strategies import trainjobs
from webhook.core.patch import _json_equal
from webhook.serving.codec import dumps, loads

INT64 = 2 ** 63

# JSON values the API server can send: integers within int64 (it decodes a custom resource's numbers
# to int64 or float64), finite floats, any text.
values = st.recursive(
    st.none() | st.booleans() | st.integers(-INT64, INT64 - 1) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=40)


def strictly_equal(a, b) -> bool:
    return a == b and _json_equal(a, b)


@given(values, st.booleans())
def test_decoding_gives_the_standard_librarys_value(value, ascii_only):
    text = json.dumps(value, ensure_ascii=ascii_only).encode()
    assert strictly_equal(loads(text), json.loads(text))


@given(values)
def test_encoding_reads_back_as_the_same_value(value):
    assert strictly_equal(json.loads(dumps(value)), value)


@given(trainjobs())
def test_reviews_and_their_answers_agree_with_the_standard_library(obj):
    doc = review(obj)
    body = json.dumps(doc).encode()
    assert strictly_equal(loads(body), json.loads(body))
    for verb in ("mutate", "validate"):
        response = admission().review(loads(body), verb)[0]
        assert strictly_equal(json.loads(dumps(response)), json.loads(json.dumps(response)))


@pytest.mark.parametrize("text", [
    b"NaN", b"[Infinity, -Infinity]", b'"\\ud800"', b"[1e400]", b"[" * 5000 + b"]" * 5000,
    b"\xef\xbb\xbf{}", b"{}x", b'"\xff"', b"", b"{'a': 1}", b'{"a":1,"a":2}', b"[99999999999999999999999]",
    b"[-9223372036854775809, 18446744073709551616, 9223372036854775807]", b'{"n": 1' + b"0" * 5000 + b"}",
])
def test_what_orjson_refuses_is_decided_by_the_standard_library(text):
    """NaN, lone surrogates, overflowing floats, nesting past orjson's 1024, a BOM, integers past 64
    bits (orjson would read them as floats): accepted or refused exactly as json.loads does, with its
    message."""
    try:
        expected = json.loads(text)
    except (ValueError, RecursionError) as e:
        with pytest.raises(type(e)) as got:
            loads(text)
        assert str(got.value) == str(e)
        return
    got = loads(text)
    if isinstance(expected, float) and math.isnan(expected):
        assert math.isnan(got)
    else:
        assert strictly_equal(got, expected)


def test_what_orjson_cannot_encode_is_written_by_the_standard_library():
    for value in ({"message": "\ud800"}, {"n": 2 ** 70}):
        assert json.loads(dumps(value)) == value


def test_example_reviews_round_trip():
    for obj in (trainjob(), trainjob(runtime_name="mpi")):
        doc = review(obj)
        assert strictly_equal(loads(dumps(doc)), doc)
