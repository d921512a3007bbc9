"""Settings (SPEC 2): strict decoding of one JSON document into an immutable Settings.

The JSON Schema is produced here and the parser validates with it, so the published Schema and the
parser agree; what the Schema cannot express (unique credential names, overlapping mount paths,
duplicate keys) the parser checks after it (webhook.core.credential_mounts, webhook.core.strict_json). Every
refusal is ErrInvalid naming the key path.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any, cast

import jsonschema

from . import images, paths
from .credential_mounts import credential_reasons
from .errors import RULE_SETTINGS, Denied, ErrInvalid, Reason, Reasons
from .strict_json import decode, join_key, key_path, strict_reasons

DEFAULT_MANAGER = "dispatch.go.phpboyscout.uk/publish"
PUBLISH_VOLUME = "dispatch-publish"
DEFAULT_INIT_CONTAINER = "dispatch-publish"
ROUTE_IMAGE_VOLUME = "imageVolume"
ROUTE_INIT_CONTAINER = "initContainer"

DNS1123_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# k8s IsDomainPrefixedPath: a DNS-1123 subdomain, a slash, then a non-empty HTTP path.
DOMAIN_PREFIXED_PATH = (
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/[A-Za-z0-9/\-._~%!$&'()*+,;=:]+$"
)

# Every list the settings hold is bounded (issue 47): each credential is a volume and a mount in the entry written
# into every TrainJob, so 100 of them, each at most 63 + 253 characters of names and its path, keep the entry far
# under the API server's object size; a document past it is refused naming the key, before any pod takes it.
MAX_CREDENTIALS = 100

# An example digest, for the example settings and `serve --dev` only.
EXAMPLE_IMAGE = (
    "registry.gitlab.com/phpboyscout/go/dispatch/publish@sha256:"
    "0f3c8a1d2b4e5f60718293a4b5c6d7e8f9012a3b4c5d6e7f8091a2b3c4d5e6f7"
)


@dataclass(frozen=True)
class Credential:
    name: str
    secret: str
    mount_path: str

    @cached_property
    def mount_root(self) -> str:
        """The mount path normalised (SPEC 3), as the rules compare it."""
        return paths.normalise(self.mount_path)


@dataclass(frozen=True)
class Publish:
    image: str
    via: str = ROUTE_IMAGE_VOLUME
    init_container: str = DEFAULT_INIT_CONTAINER


@dataclass(frozen=True)
class Settings:
    manager: str = DEFAULT_MANAGER
    publish: Publish | None = None
    credentials: tuple[Credential, ...] = field(default_factory=tuple)

    @property
    def configured(self) -> bool:
        """Whether the webhook writes an entry at all (SPEC 6.1)."""
        return self.publish is not None or bool(self.credentials)


EXAMPLE = {
    "manager": DEFAULT_MANAGER,
    "publish": {"image": EXAMPLE_IMAGE, "via": ROUTE_IMAGE_VOLUME},
    "credentials": [{"name": "checkpoint-store", "secret": "s3-credentials", "mountPath": "/var/run/dispatch/creds"}],
}


@lru_cache(maxsize=1)
def schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of the settings document."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://dispatch.go.phpboyscout.uk/schemas/dispatch-admission-settings.json",
        "title": "dispatch-admission settings",
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "manager": {
                "description": "The spec.runtimePatches key this webhook owns: a domain-prefixed path.",
                "type": "string",
                "maxLength": 253,
                "pattern": DOMAIN_PREFIXED_PATH,
                "default": DEFAULT_MANAGER,
            },
            "publish": _publish_schema(),
            "credentials": _credentials_schema(),
        },
    }


def _publish_schema() -> dict[str, Any]:
    return {
        "description": ("Where the publish binary comes from. Absent: nothing is mounted at /opt/dispatch, and"
                        " every rule still holds."),
        "type": "object",
        "additionalProperties": False,
        "required": ["image"],
        "properties": {
            "image": {
                "description": ("The publish image, NAME@sha256:<64 lower-case hex digits>, no tag"
                                " (a registry port is not a tag: host:5000/p@sha256:... and"
                                " [fd00::1]:5000/p@sha256:... are fine)."),
                "type": "string",
                "pattern": images.PINNED_PATTERN,
            },
            "via": {
                "description": "imageVolume (route 1) or initContainer (route 2).",
                "enum": [ROUTE_IMAGE_VOLUME, ROUTE_INIT_CONTAINER],
                "default": ROUTE_IMAGE_VOLUME,
            },
            "initContainer": {
                "description": ("Route 2 only: the init container, defined by the runtime, that copies"
                                " the binary to $DISPATCH_PUBLISH_DEST."),
                "type": "string",
                "maxLength": 63,
                "pattern": DNS1123_LABEL,
                "default": DEFAULT_INIT_CONTAINER,
            },
        },
        "dependentSchemas": {
            "initContainer": {"required": ["via"], "properties": {"via": {"const": ROUTE_INIT_CONTAINER}}}
        },
    }


def _credentials_schema() -> dict[str, Any]:
    return {
        "description": (f"Secrets mounted read-only on the node container beside the publish mount: at most"
                        f" {MAX_CREDENTIALS}."),
        "type": "array",
        "maxItems": MAX_CREDENTIALS,
        "items": {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "secret", "mountPath"],
            "properties": {
                "name": {
                    "description": "The volume's name: a unique DNS-1123 label, not dispatch-publish.",
                    "type": "string",
                    "maxLength": 63,
                    "pattern": DNS1123_LABEL,
                    "not": {"const": PUBLISH_VOLUME},
                },
                "secret": {"description": "The Secret's name, in the TrainJob's namespace.",
                           "type": "string", "maxLength": 253, "pattern": DNS1123_SUBDOMAIN},
                "mountPath": {"description": "Absolute; overlapping (at, under or an ancestor of) neither"
                                             " /opt/dispatch, another credential's, nor a path Trainer's"
                                             " plugins mount (/etc/mpi, /etc/flux-config, /curve, /mnt/flux,"
                                             " /dev/shm, /opt/software, /var/run/secrets/kubeflow/trainer).",
                              "type": "string", "pattern": "^/"},
            },
        },
    }


@lru_cache(maxsize=1)
def _validator() -> jsonschema.protocols.Validator:
    cls = jsonschema.Draft202012Validator
    cls.check_schema(schema())
    return cls(schema())


def _json_type(value: object) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {dict: "object", list: "array", str: "string", type(None): "null"}.get(type(value), type(value).__name__)


def _show(value: object) -> str:
    """A value as the user wrote it in JSON (`null`, `true`, `5`), a string quoted."""
    return repr(value) if isinstance(value, str) else json.dumps(value)[:80]


def _schema_reasons(doc: dict[str, Any], reasons: Reasons) -> None:
    """One reason per Schema error, worded from jsonschema's structured fields (path, validator, values),
    never from its English messages."""
    # Any: jsonschema types an error's fields as possibly unset; the errors iter_errors yields have them all.
    errors: list[Any] = sorted(_validator().iter_errors(doc),
                               key=lambda e: (list(map(str, e.absolute_path)), e.validator))
    for err in errors:
        where = key_path(err.absolute_path)
        base = key_path(err.absolute_path) if err.absolute_path else ""
        v = err.validator
        if err.instance is None and v != "required":
            continue  # reported by strict_reasons with the reason nulls are refused
        if "dependentSchemas" in err.schema_path:  # initContainer named without via: initContainer
            reasons.add(ErrInvalid, "publish.initContainer", "is valid only with via: initContainer", RULE_SETTINGS)
        elif v == "additionalProperties":
            allowed = err.schema.get("properties", {})
            for key in err.instance:
                if key not in allowed:
                    reasons.add(ErrInvalid, join_key(base, key) or "(document)",
                                f"unknown key (known: {', '.join(allowed)})", RULE_SETTINGS)
        elif v == "required":
            present = err.instance if isinstance(err.instance, dict) else {}
            for missing in (k for k in err.validator_value if k not in present):
                reasons.add(ErrInvalid, join_key(base, missing), "required", RULE_SETTINGS)
        elif v == "type":
            reasons.add(ErrInvalid, where, f"must be {err.validator_value}, not {_json_type(err.instance)}",
                        RULE_SETTINGS)
        elif v == "enum":
            reasons.add(ErrInvalid, where,
                        f"must be one of {', '.join(err.validator_value)}, not {_show(err.instance)}",
                        RULE_SETTINGS)
        elif v == "not":
            reasons.add(ErrInvalid, where, f"{_show(err.instance)} is reserved for the publish volume", RULE_SETTINGS)
        elif v == "pattern":
            reasons.add(ErrInvalid, where, _pattern_text(err.absolute_path, err.instance), RULE_SETTINGS)
        elif v == "maxLength":
            reasons.add(ErrInvalid, where, f"must be at most {err.validator_value} characters", RULE_SETTINGS)
        else:  # a keyword this Schema does not use today: name it and its value
            reasons.add(ErrInvalid, where, f"fails the Schema's {v} {_show(err.validator_value)}", RULE_SETTINGS)


def _pattern_text(path: Sequence[str | int], value: str) -> str:
    last = path[-1] if path else ""
    if last == "image":
        return f"{value!r} {images.pinned_problem(value)}"
    if last == "manager":
        return f"{value!r} must be a domain-prefixed path such as {DEFAULT_MANAGER}"
    if last == "mountPath":
        return f"{value!r} must be an absolute path"
    if last == "secret":
        return f"{value!r} must be a Secret name (a DNS-1123 subdomain)"
    return f"{value!r} must be a DNS-1123 label (lower-case letters, digits and '-')"


def parse(text: str | bytes) -> Settings:
    """Decode, validate and default one settings document. Raises Denied (ErrInvalid) naming key paths."""
    doc = decode(text)
    reasons = Reasons()
    if not isinstance(doc, dict):
        reasons.add(ErrInvalid, "(document)", f"must be a JSON object, not {_json_type(doc)}")
        reasons.raise_if_any()
    obj = cast(dict[str, Any], doc)  # a JSON object: anything else was refused above
    _refuse_over_bounds(obj)
    strict_reasons(obj, "", reasons)
    _schema_reasons(obj, reasons)
    credential_reasons(obj, reasons)
    reasons.raise_if_any()
    return _build(obj)


def _refuse_over_bounds(doc: dict[str, Any]) -> None:
    """A list past its bound (the Schema's maxItems) is refused at once, before any of its items is checked: the
    work done on a document stays bounded whatever its length."""
    creds = doc.get("credentials")
    if isinstance(creds, list) and len(creds) > MAX_CREDENTIALS:
        raise Denied([Reason(ErrInvalid, "credentials",
                             f"must hold at most {MAX_CREDENTIALS} items, not {len(creds)}", RULE_SETTINGS)])


def _build(doc: dict[str, Any]) -> Settings:
    publish = None
    if "publish" in doc:
        p = doc["publish"]
        publish = Publish(
            image=p["image"],
            via=p.get("via", ROUTE_IMAGE_VOLUME),
            init_container=p.get("initContainer", DEFAULT_INIT_CONTAINER),
        )
    creds = tuple(Credential(c["name"], c["secret"], c["mountPath"]) for c in doc.get("credentials", ()))
    return Settings(manager=doc.get("manager", DEFAULT_MANAGER), publish=publish, credentials=creds)


def example_json() -> str:
    return json.dumps(EXAMPLE, indent=2) + "\n"
