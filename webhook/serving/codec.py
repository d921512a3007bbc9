"""The JSON of a review: orjson where it reads and writes what the standard library would, else the standard
library, so what is accepted and what is written stay the standard library's JSON values."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import orjson


def dumps(body: Mapping[str, Any]) -> bytes:
    """Compact JSON. orjson where it can (a review's encode and decode are a fifth of its CPU with the
    standard library); the standard library for what orjson refuses (lone surrogates, integers past
    64 bits), so what is accepted and what is written stay the standard library's JSON values."""
    try:
        return orjson.dumps(body)
    except TypeError:  # orjson.JSONEncodeError
        return json.dumps(body, separators=(",", ":")).encode()


# orjson reads an integer past 64 bits as a float: a body with 19 digits in a row skips it. Found by
# mapping every digit to "0" and everything else to " " (bytes.translate and a substring search run at
# memory speed: a regex took 10 times longer, 22 µs on a 2 KB review and 0.1-0.2 s on a 7 MiB body).
_DIGITS_AS_ZERO = bytes(48 if 48 <= b <= 57 else 32 for b in range(256))
_LONG_NUMBER = b"0" * 19


def loads(body: bytes):
    """A request body as the standard library's json.loads reads it (and refuses it, with its message):
    orjson first; what orjson refuses (NaN, lone surrogates, nesting past 1,024, or no JSON at all) or would
    read differently (19 digits or more in a row) goes to the standard library, which decides. One
    difference remains: nesting between the standard library's limit (a little under 1,000 levels, less
    the caller's stack) and orjson's 1,024 is read, and the rules judge it (a structure they must walk
    that deep is refused as nested too deeply; tests/server/test_hostile.py)."""
    if _LONG_NUMBER not in body.translate(_DIGITS_AS_ZERO):
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            pass
    return json.loads(body)


# The bound of a body's parsed form, found before parsing (issue 47): a 7 MiB body of `[[],[],...]` parses to
# 157 MB (2.4 million lists) and holds the interpreter a second; a 7 MiB string, to 7 MiB. Every JSON value
# but the first is a container's first member (after '[' or '{'), or follows a ',' or a ':'; so the values,
# keys included, are at most 1 + the count of those four bytes (a string holding them only raises the count).
# Each value takes at most PER_VALUE bytes besides its characters: a one-key dict, 184 bytes and the pointer
# to it, over its three counted bytes ('{', ':', ','); a list 56, an int 28, a float 24, a str 49 (measured on
# CPython 3.11; tests/unit/test_parsed_bound.py checks the bound over the worst shapes). Characters take one byte
# each in a str of ASCII or Latin-1, up to four (PEP 393) when the body has any byte past ASCII or a \u escape.
# Depth needs no bound of its own here: it costs what its values cost, and past 1,024 levels orjson refuses
# and the standard library's recursion limit (a 400) decides. bytes.count runs at memory speed: 4 counts of a
# 7 MiB body take about 10 ms, its parse 1 s.
PER_VALUE = 80
_WIDE = 4  # bytes a character may take in a str (UCS-4)


def parsed_bound(body: bytes) -> int:
    """An upper bound, in bytes, of what `loads(body)` allocates, from counts of the body's bytes alone."""
    values = 1 + body.count(b",") + body.count(b":") + body.count(b"[") + body.count(b"{")
    narrow = body.isascii() and b"\\u" not in body
    return (1 if narrow else _WIDE) * len(body) + PER_VALUE * values
