"""Where the publish image may come from, fixed at deploy time (issue 35).

The settings are live (SPEC 2.1): whoever can edit their ConfigMap changes what runs in every tenant's node
container. So the repositories the settings may name are fixed when the webhook starts (`serve
--publish-repositories`, the chart's `publish.repositories`, by default the repository of `publish.image`):
a live edit can move the digest within them, never the source. Settings naming another repository are
invalid like any other (ErrInvalid on `publish.image`): the last good settings stay in use.
"""

from __future__ import annotations

from . import images
from .errors import Denied, ErrInvalid, Reason
from .settings import Settings

FLAG = "--publish-repositories"


def parse_repositories(text: str) -> frozenset[str]:
    """`--publish-repositories`: repository names separated by commas; empty: none (no settings may name a
    publish image). Raises Denied naming the flag and the entry that is not a repository."""
    names = [n.strip() for n in text.split(",")] if text.strip() else []
    bad = [Reason(ErrInvalid, FLAG, f"{n!r} {images.repository_problem(n) if n else 'is empty'}")
           for n in names if not n or images.repository_problem(n)]
    if bad:
        raise Denied(bad)
    return frozenset(names)


def repositories_of(settings: Settings) -> frozenset[str]:
    """The default: the repository of the settings the webhook started with (none without a publish image)."""
    return frozenset({images.repository(settings.publish.image)} if settings.publish else ())


def check(settings: Settings, allowed: frozenset[str]) -> Settings:
    """`settings` when their publish image comes from an allowed repository (or they name none); else Denied."""
    if settings.publish is None:
        return settings
    name = images.repository(settings.publish.image)
    if name not in allowed:
        fixed = ", ".join(sorted(allowed)) or "none"
        raise Denied([Reason(ErrInvalid, "publish.image",
                             f"repository {name!r} is not one fixed at deploy time ({FLAG}: {fixed}); live settings"
                             " may move the digest, not the repository: change the repositories with a deploy")])
    return settings


def switch_line(source: str, old: Settings, new: Settings) -> dict[str, object]:
    """The log line of a switch: what is now in force, and the publish image it replaced (issue 35: a switch of
    the image that runs in every tenant's node container is never silent)."""
    return {"msg": "settings switched", "source": source, "manager": new.manager,
            "publish": new.publish.image if new.publish else None,
            "previous_publish": old.publish.image if old.publish else None,
            "via": new.publish.via if new.publish else None,
            "credentials": [c.name for c in new.credentials]}
