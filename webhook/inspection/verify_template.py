"""`verify` (SPEC 9), the stored pod template against the settings: the publish mount and image the settings
(else the stored entry) say, against what the probe's pod holds, and the entry the settings produce.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..core import paths
from ..core.patch import Entry
from ..core.registry import NODE_CONTAINER
from ..core.runtimes import RuntimeFacts
from ..core.settings import PUBLISH_VOLUME, ROUTE_INIT_CONTAINER, Settings
from .verify import entry_publish_image, route_of


@dataclass(frozen=True)
class Check:
    """One thing the settings say against what the stored pod template holds."""
    what: str
    expected: str
    found: str

    @property
    def ok(self) -> bool:
        return self.expected == self.found


def _mount(container: dict[str, Any]) -> dict[str, Any] | None:
    return next((m for m in container.get("volumeMounts") or [] if m.get("name") == PUBLISH_VOLUME), None)


def _describe_mount(m: dict[str, Any] | None) -> str:
    if m is None:
        return "no mount"
    return f"{m.get('mountPath')} {'read-only' if m.get('readOnly') else 'read-write'}"


def template_checks(pod: dict[str, Any] | None, entry: dict[str, Any] | None, settings: Settings | None,
                    expected: Entry | None = None) -> list[Check]:
    """What the settings say (else the stored entry) against what the probe's pod holds: the publish mount
    read-only at /opt/dispatch on the node container, and the image (route 1: the image volume's reference;
    route 2: an emptyDir the init container fills). `expected`: the entry the settings produce for the runtime."""
    checks: list[Check] = []
    if entry is not None and expected is not None:
        checks.append(Check("entry", "as the settings produce it",
                            "as the settings produce it" if expected.matches(entry)
                            else "differs from what the settings produce"))
    if pod is None:
        return checks
    spec = pod.get("spec") or {}
    publish = settings.publish if settings is not None else None
    node: dict[str, Any] = next((c for c in spec.get("containers") or [] if c.get("name") == NODE_CONTAINER), {})
    checks.append(Check("node container mount", f"{paths.PUBLISH_DIR} read-only", _describe_mount(_mount(node))))
    volume = next((v for v in spec.get("volumes") or [] if v.get("name") == PUBLISH_VOLUME), None)
    route2 = publish.via == ROUTE_INIT_CONTAINER if publish is not None else route_of(entry).number == 2
    if route2:
        init_name = publish.init_container if publish is not None else route_of(entry).init_container
        init: dict[str, Any] = next((c for c in spec.get("initContainers") or [] if c.get("name") == init_name), {})
        checks.append(Check("publish volume", "emptyDir", "emptyDir" if volume and "emptyDir" in volume
                            else json.dumps(volume)))
        found = _mount(init)
        checks.append(Check(f"init container {init_name} mount", f"{paths.PUBLISH_DIR} read-write",
                            _describe_mount(found)))
    else:
        want = publish.image if publish is not None else entry_publish_image(entry)
        got = ((volume or {}).get("image") or {}).get("reference") or (json.dumps(volume) if volume else "no volume")
        checks.append(Check("image volume", want, got))
    return checks


def expected_entry(settings: Settings | None, facts: RuntimeFacts | None) -> Entry | None:
    if settings is None or facts is None or not settings.configured or not facts.targets:
        return None
    return Entry.build(settings, facts.targets)
