"""Image references (SPEC 2): the publish image must be pinned by a sha256 digest and carry no tag."""

from __future__ import annotations

import re

# The distribution reference grammar: an optional registry host (a port is not a tag), then
# lower-case path components; a tag would be a `:` after the last path component.
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
# A host is a domain name, an IPv4 address (which the domain-name rule also matches) or an IPv6 address in
# brackets, as distribution's reference grammar says (`[fd00::1]:5000/publish`).
_IPV6 = r"\[(?:[a-fA-F0-9:]+)\]"
_DOMAIN = rf"(?:{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*|{_IPV6})(?::[0-9]+)?"
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_NAME = rf"(?:{_DOMAIN}/)?{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
DIGEST_PATTERN = r"sha256:[0-9a-f]{64}"

# One pattern for the parser and for the published JSON Schema, so both accept the same references.
PINNED_PATTERN = rf"^{_NAME}@{DIGEST_PATTERN}$"
_PINNED = re.compile(PINNED_PATTERN)
REPOSITORY_PATTERN = rf"^{_NAME}$"  # a repository: the NAME alone (the chart's publish.repositories)
_NAME_RE = re.compile(REPOSITORY_PATTERN)
_TAGGED_NAME = re.compile(rf"^{_NAME}:[\w][\w.-]{{0,127}}$")


def pinned_problem(ref: str) -> str | None:
    """None when `ref` is NAME@sha256:<64 lower-case hex> with no tag; otherwise what is wrong."""
    if _PINNED.fullmatch(ref):
        return None
    name, at, digest = ref.partition("@")
    if not at:
        if _TAGGED_NAME.fullmatch(ref):
            return "references a tag, not a digest: pin it as NAME@sha256:<64 lower-case hex digits>"
        return "is not pinned by digest: use NAME@sha256:<64 lower-case hex digits>"
    if _TAGGED_NAME.fullmatch(name):
        return "carries a tag as well as a digest: drop the tag, keep NAME@sha256:<64 lower-case hex digits>"
    if not _NAME_RE.fullmatch(name):
        return "has an invalid image name before the digest"
    algorithm, _, hexdigits = digest.partition(":")
    if algorithm != "sha256":
        return f"digest algorithm must be sha256, not {algorithm!r}"
    if len(hexdigits) != 64:
        return f"sha256 digest must have exactly 64 hex digits, not {len(hexdigits)}"
    return "sha256 digest must be 64 lower-case hex digits (0-9, a-f)"


def repository(ref: str) -> str:
    """The repository of an image reference: its NAME, without the digest (and without a tag, were there one)."""
    name = ref.partition("@")[0]
    if _TAGGED_NAME.fullmatch(name):
        name = name.rpartition(":")[0]
    return name


def repository_problem(name: str) -> str | None:
    """None when `name` is a repository (an image NAME with no tag and no digest); otherwise what is wrong."""
    if "@" in name:
        return "carries a digest: name the repository only (the digest is what the settings move)"
    if _TAGGED_NAME.fullmatch(name):
        return "carries a tag: name the repository only"
    if not _NAME_RE.fullmatch(name):
        return "is not an image repository name"
    return None
