"""Path rules (SPEC 3): one normalisation that every rule comparing paths goes through."""

from __future__ import annotations

import posixpath

PUBLISH_DIR = "/opt/dispatch"


def normalise(path: str) -> str:
    """Collapse slashes (a leading `//` too), drop `.`, resolve `..`, drop a trailing slash; relative is from `/`."""
    # posixpath keeps exactly two leading slashes (POSIX leaves `//` implementation-defined); we do not.
    return posixpath.normpath("/" + path.lstrip("/"))


def at_or_under(path: str, root: str) -> bool:
    """True when `path` is `root` or inside it, after normalisation; case-sensitive."""
    p, r = normalise(path), normalise(root)
    return p == r or p.startswith(r.rstrip("/") + "/")


def overlaps(a: str, b: str) -> bool:
    """True when either path is at or under the other (so `/opt` overlaps `/opt/dispatch`)."""
    return at_or_under(a, b) or at_or_under(b, a)


def under_publish_dir(path: str) -> bool:
    return at_or_under(path, PUBLISH_DIR)
