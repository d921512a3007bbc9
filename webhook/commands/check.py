"""`dispatch-admission check` (SPEC 7): judge TrainJob manifests offline, as the webhook would answer them.

Only TrainJobs of trainer.kubeflow.org/v1alpha1 are judged: that is the version the webhook registers for, so
a TrainJob of another apiVersion (or none) would never reach it, and the API server refuses a version it does
not serve. Such a TrainJob is reported as not served, by name, and makes the exit code 2; so does a run that
judged nothing (an empty file, only `---`, only other kinds): a CI gate must not pass on what it never saw.

Three outputs: `text` for people, `json` (the versioned shape of check_report.schema.json, beside this file)
and `junit` (one testcase per TrainJob, a failure per denial) for CI systems' test reports.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import IO, Any
from xml.etree import ElementTree as ET

import yaml

from .. import api
from ..core.admission import Admission
from ..core.runtimes import GROUP, TRAINJOB_KIND, VERSION
from .files import shown, yaml_documents

REPORT_VERSION = "dispatch-admission/check/v1"
SERVED = f"{GROUP}/{VERSION}"
ADMITTED, DENIED, NOT_SERVED, SKIPPED = "admitted", "denied", "not-served", "skipped"
EXIT_OK, EXIT_DENIED, EXIT_UNUSABLE = 0, 1, 2


@dataclass
class Document:
    """One YAML document of a manifest and what check made of it."""

    file: str
    index: int  # 1-based, as `---` separates them
    api_version: str | None
    kind: str | None
    name: str | None
    namespace: str | None
    verdict: str
    code: int | None = None  # the HTTP code the API server would answer: 200 admitted, the denial's code
    message: str = ""  # the denial's message, or why it was not judged
    reasons: list[dict] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    trainjob: dict | None = None  # as the webhook mutates it, when admitted
    causes: list[str] = field(default_factory=list)  # the denial's causes as the API server lists them

    @property
    def title(self) -> str:
        return f"{self.kind or 'document'} {self.name or '?'}"


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _meta(doc: dict) -> dict:
    meta = doc.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _unjudged(path: str, n: int, doc: Any) -> Document | None:
    """The Document for what check does not judge (another kind, another apiVersion), else None."""
    if not isinstance(doc, dict):
        return Document(shown(path), n, None, None, None, None, SKIPPED,
                        message=f"not a Kubernetes object (a YAML {type(doc).__name__}), skipped")
    meta = _meta(doc)
    api_version, kind = _text(doc.get("apiVersion")), _text(doc.get("kind"))
    d = Document(shown(path), n, api_version, kind, _text(meta.get("name")), _text(meta.get("namespace")), SKIPPED)
    if kind != TRAINJOB_KIND:
        d.message = "not a TrainJob, skipped"
    elif api_version != SERVED:
        given = f"apiVersion {api_version} is not served" if api_version else "no apiVersion"
        d.verdict, d.message = NOT_SERVED, f"{given}: the webhook judges TrainJobs of {SERVED}"
    else:
        return None
    return d


def _reason(r) -> dict:
    return {"sentinel": r.sentinel.label, "code": r.sentinel.code, "field": r.field, "rule": r.rule,
            "message": r.text}


def judge(admission: Admission, path: str) -> list[Document]:
    """Every document of one manifest file (`-`: stdin), judged or said why not. InputError when unreadable."""
    out = []
    for n, doc in enumerate(yaml_documents(path), 1):
        if doc is None:  # an empty document: `---` alone, or a file of comments
            continue
        found = _unjudged(path, n, doc)
        if found is None:
            found = _judged(admission, path, n, doc)
        out.append(found)
    return out


def _judged(admission: Admission, path: str, n: int, doc: dict) -> Document:
    meta = _meta(doc)
    result = api.check_with(admission, doc, uid=f"{shown(path)}#{n}")
    d = Document(shown(path), n, SERVED, TRAINJOB_KIND, _text(meta.get("name")), _text(meta.get("namespace")),
                 ADMITTED if result.allowed else DENIED, warnings=list(result.warnings))
    if result.allowed:
        d.code, d.trainjob = 200, result.trainjob
        return d
    st = result.status
    assert st is not None  # a denial carries its Status
    d.code, d.message = st["code"], st["message"]
    d.reasons = [_reason(r) for r in result.reasons]
    d.causes = [f"{c['field']}: {c['message']}" for c in st["details"]["causes"]]
    return d


def outcome(documents: list[Document]) -> tuple[int, str]:
    """The exit code, and for 2 the one line that says why."""
    counts = Counter(d.verdict for d in documents)
    if counts[NOT_SERVED]:
        names = ", ".join(f"{d.name or '?'} ({d.file} document {d.index})" for d in documents
                          if d.verdict == NOT_SERVED)
        return EXIT_UNUSABLE, f"not judged, of an apiVersion the webhook does not serve: TrainJob {names}"
    if not counts[ADMITTED] + counts[DENIED]:
        return EXIT_UNUSABLE, f"nothing was judged: no TrainJob of {SERVED} in the manifests" + (
            f" ({counts[SKIPPED]} other document{'s' * (counts[SKIPPED] != 1)} skipped)" if counts[SKIPPED] else
            " (no document in them)")
    return (EXIT_DENIED if counts[DENIED] else EXIT_OK), ""


# ---- the outputs ----

def write_text(documents: list[Document], out: IO[str], err: IO[str]) -> None:
    for d in documents:
        for w in d.warnings:
            err.write(f"warning: {d.file}: TrainJob {d.name or '?'}: {w}\n")
        if d.verdict == ADMITTED:
            out.write(f"# {d.file}: TrainJob {d.name or '?'} admitted\n---\n")
            out.write(yaml.safe_dump(d.trainjob, sort_keys=False))
        elif d.verdict == DENIED:
            out.write(f"# {d.file}: TrainJob {d.name or '?'} denied ({d.code} {_status_reason(d)})\n{d.message}\n")
            out.writelines(f"  * {c}\n" for c in d.causes)
        else:
            err.write(f"# {d.file} document {d.index}: {d.title}: {d.message}\n")


def _status_reason(d: Document) -> str:
    from ..core.errors import Sentinel

    return next((s.reason for s in Sentinel if s.code == d.code), "")


def report(documents: list[Document], enforcement: str) -> dict:
    """The `--output json` document (check_report.schema.json)."""
    code, why = outcome(documents)
    counts = Counter(d.verdict for d in documents)
    return {
        "apiVersion": REPORT_VERSION, "kind": "CheckReport", "enforcement": enforcement,
        "exitCode": code, "error": why or None,
        "summary": {v: counts[v] for v in (ADMITTED, DENIED, NOT_SERVED, SKIPPED)},
        "documents": [{"file": d.file, "index": d.index, "apiVersion": d.api_version, "kind": d.kind,
                       "name": d.name, "namespace": d.namespace, "verdict": d.verdict, "code": d.code,
                       "message": d.message or None, "reasons": d.reasons, "warnings": d.warnings,
                       "trainjob": d.trainjob} for d in documents]}


def write_json(documents: list[Document], enforcement: str, out: IO[str]) -> None:
    json.dump(report(documents, enforcement), out, indent=2)
    out.write("\n")


def junit(documents: list[Document]) -> str:
    """JUnit XML: a testsuite per manifest file, a testcase per TrainJob; a denial is a failure, a TrainJob of
    an apiVersion not served an error. Other kinds are no testcase."""
    root = ET.Element("testsuites", name="dispatch-admission check")
    files: dict[str, list[Document]] = {}
    for d in documents:
        if d.kind == TRAINJOB_KIND:
            files.setdefault(d.file, []).append(d)
    for name, docs in files.items():
        suite = ET.SubElement(root, "testsuite", name=name, tests=str(len(docs)),
                              failures=str(sum(d.verdict == DENIED for d in docs)),
                              errors=str(sum(d.verdict == NOT_SERVED for d in docs)), skipped="0", time="0")
        for d in docs:
            _testcase(suite, d)
    for attr in ("tests", "failures", "errors"):
        root.set(attr, str(sum(int(s.get(attr, "0")) for s in root)))
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def _testcase(suite: ET.Element, d: Document) -> None:
    where = f"{d.namespace}/{d.name}" if d.namespace else (d.name or "?")
    case = ET.SubElement(suite, "testcase", classname=d.file, name=f"TrainJob {where} (document {d.index})",
                         time="0")
    if d.verdict == NOT_SERVED:
        ET.SubElement(case, "error", type="NotServed", message=d.message[:500]).text = d.message
    elif d.verdict == DENIED:
        first = d.reasons[0]["sentinel"] if d.reasons else "Denied"
        failure = ET.SubElement(case, "failure", type=first, message=f"denied ({d.code}): {d.message[:500]}")
        failure.text = "\n".join(d.causes)
    if d.warnings:
        ET.SubElement(case, "system-out").text = "\n".join(f"warning: {w}" for w in d.warnings)
