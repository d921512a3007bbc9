"""Strict JSON for the settings document (SPEC 2): what `json` and the Schema let through and the settings refuse.

`json` keeps the last of duplicate keys silently, reads NaN and Infinity, and a null would read as unset and
take the default; `decode` and `strict_reasons` refuse them all, naming the key path (`key_path`), as every
other refusal of the settings does.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from typing import Any

from .errors import Denied, ErrInvalid, Reason, Reasons

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class _Pairs(dict[str, Any]):
    """A decoded object that remembers keys it saw twice (json keeps the last one silently)."""

    duplicates: tuple[str, ...] = ()


def _object_pairs(pairs: list[tuple[str, object]]) -> _Pairs:
    obj = _Pairs(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        duplicates = []
        for k, _ in pairs:
            if k in seen:
                duplicates.append(k)
            seen.add(k)
        obj.duplicates = tuple(duplicates)
    return obj


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


_PLAIN_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")


def join_key(base: str, key: str | int) -> str:
    """`base.key`, `base[3]`, or `base["odd key"]` for a key that would not read as one."""
    if isinstance(key, int):
        return f"{base}[{key}]"
    if not _PLAIN_KEY.match(key):
        return f"{base}[{json.dumps(key)[:80]}]"
    return f"{base}.{key}" if base else key


def key_path(parts: Iterable[str | int]) -> str:
    out = ""
    for p in parts:
        out = join_key(out, p)
    return out or "(document)"


def strict_reasons(value: object, where: str, reasons: Reasons) -> None:
    """Refuse what json and the Schema let through: duplicate keys and nulls, at any depth."""
    if value is None:
        reasons.add(ErrInvalid, where or "(document)",
                    "null is not allowed: it would read as unset and take the default")
    elif isinstance(value, dict):
        for dup in getattr(value, "duplicates", ()):
            reasons.add(ErrInvalid, join_key(where, dup), "duplicate key")
        for k, v in value.items():
            strict_reasons(v, join_key(where, k), reasons)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            strict_reasons(v, join_key(where, i), reasons)
    elif isinstance(value, str) and _CONTROL.search(value):
        # Also closes the gap where a pattern's `$` matches before a trailing newline.
        reasons.add(ErrInvalid, where, "must not contain control characters (such as a newline)")
    elif isinstance(value, float) and not math.isfinite(value):
        reasons.add(ErrInvalid, where, "NaN and Infinity are not JSON")


def decode(text: str | bytes) -> object:
    """Strict JSON: no duplicate keys, NaN, Infinity or trailing data. Raises Denied."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise Denied([doc_reason(f"not UTF-8 text: {e.reason} at byte {e.start}")]) from None
    try:
        doc = json.loads(text, object_pairs_hook=_object_pairs, parse_constant=_refuse_constant)
    except json.JSONDecodeError as e:
        what = "trailing data after the document" if e.msg == "Extra data" else e.msg
        raise Denied([doc_reason(f"{what} at line {e.lineno} column {e.colno}")]) from None
    except (ValueError, RecursionError) as e:
        raise Denied([doc_reason(str(e) if isinstance(e, ValueError) else "nested too deeply")]) from None
    return doc


def doc_reason(text: str) -> Reason:
    """A refusal of the document as a whole (it is not JSON, not readable, not there)."""
    return Reason(ErrInvalid, "(document)", text)
