"""Files: settings and runtimes read from disk, for `serve --settings/--runtime` and the offline commands.

The offline commands (check, review, settings check) take `-` for stdin wherever they take a file, so a
pipeline can feed them (`kustomize build | dispatch-admission check ... -`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import yaml

from ..core.errors import Denied
from ..core.runtimes import CLUSTER_KIND, GROUP, KINDS, NAMESPACED_KIND, RuntimeIndex
from ..core.settings import Settings, parse
from ..core.strict_json import doc_reason

STDIN = "-"


class InputError(ValueError):
    """A file named on the command line that cannot be read: missing, a directory, no permission."""


class RuntimeFileError(ValueError):
    """A runtime file that cannot be used: unreadable, not YAML, or not a runtime."""


def shown(path: str) -> str:
    """How a file argument is named in messages (`-` is stdin)."""
    return "stdin" if path == STDIN else path


def read_input(path: str) -> bytes:
    """The bytes of a file argument, or of stdin for `-`; InputError names the file and why it can't be read."""
    if path == STDIN:
        return sys.stdin.buffer.read()
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory, not a file") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read: {(e.strerror or str(e)).lower()}") from None


# What one document may come to with its aliases expanded (scalars' characters plus one a node): the API server's
# limit on an object (3 MiB). Aliases are taken, as kubectl takes them, but a few lines of nested anchors expand
# to gigabytes (a "billion laughs"): measured before the document is built, on the graph PyYAML composes.
MAX_EXPANDED = 3 * 1024 * 1024


def yaml_documents(path: str) -> list:
    """Every YAML document of a file argument (empty ones as None); InputError when unreadable, not YAML, or a
    document larger than MAX_EXPANDED once its aliases are expanded."""
    data = read_input(path)
    try:
        loader = yaml.SafeLoader(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise InputError(f"{shown(path)}: not YAML: not UTF-8 at byte {e.start}") from None
    docs: list = []
    try:
        while loader.check_node():
            node = loader.get_node()
            if node is None:  # an empty document
                docs.append(None)
                continue
            if expanded_size(node) > MAX_EXPANDED:
                raise InputError(f"{shown(path)}: document {len(docs) + 1} comes to more than {MAX_EXPANDED} bytes "
                                 "with its YAML aliases expanded (the API server takes at most 3 MiB)")
            docs.append(loader.construct_document(node))
        return docs
    except yaml.YAMLError as e:
        raise InputError(f"{shown(path)}: not YAML: {_one_line(e)}") from None
    finally:
        loader.dispose()


def expanded_size(root: yaml.Node) -> int:
    """The size of a composed YAML node with every alias expanded: one a node plus its scalar's characters, each
    shared node counted as often as it is referred to (computed once a node: linear in the graph)."""
    sizes: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in sizes:
            continue
        if isinstance(node, yaml.ScalarNode):
            sizes[id(node)] = 1 + len(node.value)
            continue
        children = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else node.value
        if children_done:
            sizes[id(node)] = 1 + sum(sizes.get(id(c), 0) for c in children)
        else:
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in sizes)
    return sizes[id(root)]


def _one_line(e: yaml.YAMLError) -> str:
    """PyYAML's error in one line: what, and where (its own message spans four, with a caret)."""
    mark = getattr(e, "problem_mark", None)
    what = " ".join(str(getattr(e, "problem", None) or e).split())
    return f"{what} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else what


def read_settings(path: str) -> Settings:
    """Settings from a file argument (`-`: stdin): InputError when unreadable, Denied (ErrInvalid) when invalid."""
    return parse(read_input(path))


def load_settings(path: str) -> Settings:
    """Read and parse a settings file; an unreadable file is ErrInvalid too (serve: the settings it follows)."""
    try:
        with open(path, "rb") as f:
            text = f.read()
    except OSError as e:
        raise Denied([doc_reason(f"cannot read settings file {path}: {e.strerror}")]) from None
    return parse(text)


def load_runtimes(paths: Iterable[str]) -> RuntimeIndex:
    """Runtimes from YAML files (`-`: stdin), each holding one or more ClusterTrainingRuntime or TrainingRuntime
    documents."""
    found: list[dict] = []
    for path in paths:
        try:
            docs = yaml_documents(path)
        except InputError as e:
            raise RuntimeFileError(str(e)) from None
        for i, doc in enumerate(docs):
            if doc is None:
                continue
            found.append(_check_runtime(doc, f"{shown(path)} document {i + 1}"))
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
