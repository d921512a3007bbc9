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
    return within(normalise(path), normalise(root))


def within(path: str, root: str) -> bool:
    """`at_or_under` for paths already normalised (a rule comparing one path with several roots)."""
    return path == root or path.startswith(root if root == "/" else root + "/")


def overlaps(a: str, b: str) -> bool:
    """True when either path is at or under the other (so `/opt` overlaps `/opt/dispatch`)."""
    return at_or_under(a, b) or at_or_under(b, a)


def under_publish_dir(path: str) -> bool:
    return at_or_under(path, PUBLISH_DIR)


# Characters that render like ASCII ones in paths and names: zero-width ones vanish, homoglyphs fold.
# NFKC already folds fullwidth forms (／, ｏ) and compatibility characters; this adds what it leaves.
_INVISIBLE = dict.fromkeys(map(ord, "\u200b\u200c\u200d\u2060\ufeff\u00ad\u180e"), None)
_HOMOGLYPHS = str.maketrans({
    "\u0430": "a", "\u0441": "c", "\u0435": "e", "\u043e": "o", "\u0440": "p", "\u0456": "i", "\u0455": "s",
    "\u04bb": "h", "\u0445": "x", "\u0443": "y", "\u0442": "t", "\u03bf": "o", "\u03c1": "p", "\u03b9": "i",
    "\u03b1": "a", "\u03c4": "t", "\u0410": "A", "\u0421": "C", "\u0415": "E", "\u041e": "O", "\u0420": "P",
    "\u0406": "I", "\u0405": "S", "\u041d": "H", "\u0422": "T", "\u0399": "I", "\u039f": "O", "\u03a1": "P",
    "\u03a4": "T", "\u0391": "A", "\u2215": "/", "\u2044": "/", "\u29f8": "/", "\u2024": ".", "\u2010": "-",
    "\u2011": "-", "\u2012": "-", "\u2013": "-", "\u2212": "-", "\u02cd": "_",
})


def skeleton(text: str) -> str:
    """What `text` looks like: NFKC, invisible characters dropped, common homoglyphs folded to ASCII."""
    import unicodedata

    if text.isascii():
        return text
    return unicodedata.normalize("NFKC", text).translate(_INVISIBLE).translate(_HOMOGLYPHS)


def looks_under_publish_dir(path: str) -> bool:
    """A path that is not under /opt/dispatch but reads as if it were (a look-alike)."""
    return not path.isascii() and not under_publish_dir(path) and under_publish_dir(skeleton(path))
