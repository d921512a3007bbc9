"""Files: settings and runtimes read from disk, for `serve --settings/--runtime` and the offline commands."""

from __future__ import annotations

from collections.abc import Iterable

import yaml

from ..core.errors import Denied
from ..core.runtimes import CLUSTER_KIND, GROUP, KINDS, NAMESPACED_KIND, RuntimeIndex
from ..core.settings import Settings, doc_reason, parse


class RuntimeFileError(ValueError):
    """A runtime file that cannot be used: unreadable, not YAML, or not a runtime."""


def load_settings(path: str) -> Settings:
    """Read and parse a settings file; an unreadable file is ErrInvalid too."""
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError as e:
        raise Denied([doc_reason(f"cannot read settings file {path}: {e.strerror}")]) from None
    return parse(text)


def load_runtimes(paths: Iterable[str]) -> RuntimeIndex:
    """Runtimes from YAML files, each holding one or more ClusterTrainingRuntime or TrainingRuntime documents."""
    found: list[dict] = []
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                docs = list(yaml.safe_load_all(f))
        except OSError as e:
            raise RuntimeFileError(f"{path}: cannot read: {e.strerror}") from None
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            raise RuntimeFileError(f"{path}: not YAML: {e}") from None
        for i, doc in enumerate(docs):
            if doc is None:
                continue
            found.append(_check_runtime(doc, f"{path} document {i + 1}"))
    return RuntimeIndex(found)


def _check_runtime(doc, where: str) -> dict:
    if not isinstance(doc, dict):
        raise RuntimeFileError(f"{where}: not a mapping")
    kind, meta = doc.get("kind"), doc.get("metadata")
    if kind not in KINDS:
        raise RuntimeFileError(f"{where}: kind must be {CLUSTER_KIND} or {NAMESPACED_KIND}, not {kind!r}")
    api = str(doc.get("apiVersion", ""))
    if api.split("/")[0] != GROUP:
        raise RuntimeFileError(f"{where}: apiVersion must be {GROUP}/v1alpha1, not {api!r}")
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str) or not meta["name"]:
        raise RuntimeFileError(f"{where}: metadata.name is required")
    if kind == NAMESPACED_KIND and not meta.get("namespace"):
        raise RuntimeFileError(f"{where}: a TrainingRuntime needs metadata.namespace")
    if not isinstance(doc.get("spec", {}), dict):
        raise RuntimeFileError(f"{where}: spec must be a mapping")
    return doc
