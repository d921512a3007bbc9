"""webhook.serving.codec.parsed_bound (issue 47, item 3): the bound of a body's parsed form, found from counts of
its bytes before parsing, is never below what parsing it allocates, over the shapes that cost the most per
byte (empty containers, one-key objects, short strings, wide characters) and a real review; and it is cheap."""

from __future__ import annotations

import json
import time
import tracemalloc

import pytest

from tests.helpers import review, trainjob
from webhook.serving.codec import loads, parsed_bound

N = 200_000  # bytes of each shape


def shaped(item: bytes, wrap=b"[]") -> bytes:
    return wrap[:1] + b",".join([item] * (N // (len(item) + 1))) + wrap[1:]


SHAPES = {
    "empty lists": shaped(b"[]"),
    "empty objects": shaped(b"{}"),
    "one-key objects": shaped(b'{"a":"x"}'),
    "objects of an object": shaped(b'{"a":{}}'),
    "nested lists": b"[" * 1000 + b"]" * 1000,
    "short strings": shaped(b'"a"'),
    "floats": shaped(b"1.5"),
    "large integers": shaped(b"12345678901234567"),
    "keys": b"{" + b",".join(b'"k%d":1' % i for i in range(N // 10)) + b"}",
    "a wide string": json.dumps(["\U0001F600" + "x" * N], ensure_ascii=False).encode(),
    "an escaped wide string": json.dumps(["\U0001F600" + "x" * N]).encode(),
    "a review": json.dumps(review(trainjob())).encode(),
}


def allocated(body: bytes) -> int:
    tracemalloc.start()
    try:
        doc = loads(body)
        size, _ = tracemalloc.get_traced_memory()
        del doc
        return size
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("shape", SHAPES)
def test_the_bound_is_never_below_what_parsing_allocates(shape):
    body = SHAPES[shape]
    assert parsed_bound(body) >= allocated(body), shape


@pytest.mark.timing  # a time bound: run alone, after the parallel pass (make test)
def test_a_nested_list_body_at_the_size_limit_is_bounded_far_past_the_budget_quickly():
    body = b"[" + b",".join([b"[]"] * (7 * 1024 * 1024 // 3)) + b"]"
    started = time.perf_counter()
    bound = parsed_bound(body)
    elapsed = time.perf_counter() - started
    assert bound > 4 * 64 * 1024 * 1024 and elapsed < 0.1, (bound, elapsed)
