"""The upstream corpus (issue 34): the TrainJobs and runtimes Trainer ships in its Go module, as a cluster holds them.

Read from the module in the Go module cache (tests/e2e/toolchain.py fetches it; nothing is copied into this
repository): every YAML file, every fenced block of a Markdown page and every raw string of a Go file that holds
a `trainer.kubeflow.org` TrainJob, ClusterTrainingRuntime or TrainingRuntime. A file that names one of those kinds
and is neither read nor listed in NOT_READ (with the reason) fails the corpus tests, so a new kind of carrier in
a later module is looked at, and a new example in a file that is read is tested by default.

The cluster holds every runtime of the corpus: the stock runtimes of manifests/base/runtimes first, then the others
in path order, the first of one kind, namespace and name winning; a TrainJob sees its own file's runtimes over
those (a reader applies the page's runtime with its job). Each runtime is also reviewed through a probe, the least
TrainJob naming it. Namespaced objects without a namespace are in `default`, as kubectl puts them.
`python -m tests.corpus` prints every file read, its objects and their outcome under each settings case.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import yaml

GROUP = "trainer.kubeflow.org"
RUNTIME_KINDS = ("ClusterTrainingRuntime", "TrainingRuntime")
KINDS = ("TrainJob", *RUNTIME_KINDS)
NAMESPACED = ("TrainJob", "TrainingRuntime")
DEFAULT_NAMESPACE = "default"
STOCK = "manifests/base/runtimes/"
_KIND = "|".join(KINDS)
# A file that may carry one of the kinds: YAML `kind: X` or JSON `"kind": "X"`.
MARKER = re.compile(rf'(?:^|[^A-Za-z"])kind:\s*"?(?:{_KIND})\b|"kind":\s*"(?:{_KIND})"', re.M)

# Files (or folders, ending in /) of the module that name the kinds but hold no manifest to apply, and why.
NOT_READ = {
    "charts/": "Helm templates of the runtimes in manifests/base/runtimes ({{ }} in labels and images), not manifests",
    "manifests/base/crds/": "the CRDs: the schema the API server checks the objects against (tests/e2e/test_corpus.py)",
    "proposals/": "design proposals: drafts of the API before it shipped, not manifests to apply",
    "pkg/initializers/dataset/cache_test.py": "mocked API responses (apiVersion, kind and metadata only, no spec)",
    "test/integration/controller/trainjob_controller_test.go": "substrings asserted in a snapshot, not manifests",
}


@dataclass(frozen=True)
class Doc:
    """One object of the corpus: its file in the module, where in the file, and the object (namespace filled)."""

    source: str
    where: str          # "doc N" in a YAML file, "line N" (the block's first line) in Markdown or Go
    obj: dict

    @property
    def kind(self) -> str:
        return self.obj["kind"]

    @property
    def name(self) -> str:
        return str(self.obj["metadata"].get("name"))

    @property
    def namespace(self) -> str:
        return self.obj["metadata"].get("namespace", "") if self.kind in NAMESPACED else ""

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.kind, self.namespace, self.name)

    @property
    def object(self) -> str:
        return f"{self.kind} {self.namespace + '/' if self.namespace else ''}{self.name}"

    @property
    def id(self) -> str:
        return f"{self.source} ({self.where}) {self.object}"


def _blocks(rel: str, text: str) -> list[tuple[str, str]]:
    """(where, YAML text) of each place of a file that may hold a manifest."""
    if rel.endswith((".yaml", ".yml")):
        return [("", text)]
    found = []
    if rel.endswith(".md"):  # fenced blocks, indented ones (in lists) too
        for m in re.finditer(r"^([ \t]*)```[^\n]*\n(.*?)^\1```", text, re.M | re.S):
            indent = m.group(1)
            body = "\n".join(ln[len(indent):] if ln.startswith(indent) else ln for ln in m.group(2).split("\n"))
            found.append((f"line {text.count(chr(10), 0, m.start()) + 2}", body))
    elif rel.endswith(".go"):  # raw string literals
        for m in re.finditer(r"`([^`]*)`", text):
            found.append((f"line {text.count(chr(10), 0, m.start()) + 1}", m.group(1)))
    return found


def _manifests(where: str, body: str) -> list[tuple[str, dict]]:
    try:
        docs = list(yaml.safe_load_all(body))
    except yaml.YAMLError:
        return []
    out = []
    for i, d in enumerate(docs, 1):
        if isinstance(d, dict) and d.get("kind") in KINDS and str(d.get("apiVersion", "")).startswith(GROUP + "/"):
            d = copy.deepcopy(d)
            meta = d.setdefault("metadata", {})
            if d["kind"] in NAMESPACED:
                meta.setdefault("namespace", DEFAULT_NAMESPACE)
            label = where or f"doc {i}"
            out.append((label if not where or len(docs) == 1 else f"{where} doc {i}", d))
    return out


@dataclass(frozen=True)
class Corpus:
    root: Path
    docs: tuple[Doc, ...]
    read: tuple[str, ...]        # every file that held at least one object, in path order
    unread: tuple[str, ...]      # files (or blocks) that name the kinds, yield no object, and are not in NOT_READ

    @property
    def runtimes(self) -> list[Doc]:
        return [d for d in self.docs if d.kind in RUNTIME_KINDS]

    @property
    def trainjobs(self) -> list[Doc]:
        return [d for d in self.docs if d.kind == "TrainJob"]

    def cluster(self, own: list[Doc] = ()) -> dict[tuple[str, str, str], Doc]:
        """The runtimes the cluster holds, by key, for a TrainJob whose file defines `own`."""
        held: dict[tuple[str, str, str], Doc] = {}
        for d in sorted(self.runtimes, key=lambda d: not d.source.startswith(STOCK)):
            held.setdefault(d.key, d)
        for d in own:
            held[d.key] = d
        return held

    def of_file(self, source: str) -> list[Doc]:
        return [d for d in self.docs if d.source == source]


def skipped(rel: str) -> str | None:
    return next((why for prefix, why in NOT_READ.items() if rel == prefix or
                 (prefix.endswith("/") and rel.startswith(prefix))), None)


def read(root: Path) -> Corpus:
    docs, read_files, unread = [], [], []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if skipped(rel) is not None:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not MARKER.search(text):
            continue
        found = []
        for w, body in _blocks(rel, text):
            got = _manifests(w, body)
            if not got and MARKER.search(body):  # names a kind, yet nothing could be read from it
                unread.append(f"{rel} ({w})" if w else rel)
            found += [Doc(rel, where, obj) for where, obj in got]
        if found:
            read_files.append(rel)
        elif not unread or not unread[-1].startswith(rel):
            unread.append(rel)
        docs += found
    return Corpus(root, tuple(docs), tuple(read_files), tuple(unread))


@lru_cache(maxsize=1)
def upstream() -> Corpus:
    """The corpus of the Trainer module the toolchain pins (downloaded into the module cache where absent)."""
    from tests.e2e import toolchain

    return read(toolchain.trainer_module())


# ---- the subjects reviewed: the TrainJobs, and one probe per runtime ----


@dataclass(frozen=True)
class Subject:
    doc: Doc                 # the TrainJob, or the runtime a probe names
    trainjob: dict
    cluster: tuple[Doc, ...]  # the runtimes the cluster holds for it

    @property
    def probe(self) -> bool:
        return self.doc.kind != "TrainJob"

    @property
    def id(self) -> str:
        return ("probe of " if self.probe else "") + self.doc.id

    def runtime(self) -> Doc | None:
        """The runtime the TrainJob names, as the cluster holds it (None: not held, or no usable reference)."""
        ref = (self.trainjob.get("spec") or {}).get("runtimeRef") or {}
        kind = ref.get("kind", "ClusterTrainingRuntime")
        ns = self.trainjob["metadata"]["namespace"] if kind == "TrainingRuntime" else ""
        return next((d for d in self.cluster if d.key == (kind, ns, ref.get("name"))), None)


def probe(runtime: Doc, index: int) -> dict:
    """The least TrainJob naming `runtime`: what any TrainJob on it is given at least."""
    ns = runtime.namespace or DEFAULT_NAMESPACE
    return {"apiVersion": f"{GROUP}/v1alpha1", "kind": "TrainJob",
            "metadata": {"name": f"probe-{index}", "namespace": ns},
            "spec": {"runtimeRef": {"apiGroup": GROUP, "kind": runtime.kind, "name": runtime.name}}}


def subjects(corpus: Corpus) -> list[Subject]:
    out = []
    for d in corpus.trainjobs:
        own = [r for r in corpus.of_file(d.source) if r.kind in RUNTIME_KINDS]
        out.append(Subject(d, d.obj, tuple(corpus.cluster(own).values())))
    for i, r in enumerate(corpus.runtimes):
        out.append(Subject(r, probe(r, i), tuple(corpus.cluster([r]).values())))
    return out


if __name__ == "__main__":  # the table of the closing report: python -m tests.corpus
    from tests.corpus_cases import report

    report(upstream())
