"""The upstream corpus through the webhook's review path (issue 34 item 2): (a) admitted or refused as SPEC says
(tests/corpus_cases.py holds the reviewed table), and (d) no volume or mount of the webhook's entry meeting another
of its name or path in the pods Trainer and JobSet build; also the part of (c) Trainer v2.3.0's webhook leaves
out: the entry names no job or container the runtime lacks. (b) and (c) on the API server: tests/e2e/test_corpus.py.
"""

from __future__ import annotations

import pytest

from tests import corpus as corpus_mod
from tests.corpus import NOT_READ, STOCK, read, subjects, upstream
from tests.corpus_cases import CASES, ISSUE_34, run, settings_outcome


@pytest.fixture(scope="module")
def corpus():
    return upstream()


def test_every_file_naming_the_kinds_is_read_or_set_aside_with_a_reason(corpus):
    assert corpus.unread == (), f"files or blocks naming a Trainer kind, neither read nor in NOT_READ: {corpus.unread}"
    for prefix in NOT_READ:  # an entry that no longer matches anything is stale
        assert (corpus.root / prefix).exists(), prefix


def test_the_corpus_holds_the_stock_runtimes_the_examples_and_the_docs(corpus):
    stock = sorted(p.relative_to(corpus.root).as_posix() for p in (corpus.root / STOCK).rglob("*.yaml")
                   if p.name != "kustomization.yaml")
    assert stock and set(stock) <= set(corpus.read)
    examples = sorted(p.relative_to(corpus.root).as_posix() for p in (corpus.root / "examples").rglob("*.yaml"))
    assert examples and set(examples) <= set(corpus.read)
    assert any(f.startswith("docs/") for f in corpus.read) and any(f.endswith(".go") for f in corpus.read)
    assert len(corpus.trainjobs) >= 15 and len(corpus.runtimes) >= 20


def test_every_table_entry_names_a_subject_of_the_corpus(corpus):
    ids = {s.id for s in subjects(corpus)}
    for case in CASES:
        assert set(case.exceptions) <= ids, (case.id, set(case.exceptions) - ids)
    by_id = {c.id: c for c in CASES}
    for case_id, what in ISSUE_34:
        assert case_id in by_id and (what in ids or what == "settings"), (case_id, what)


@pytest.mark.parametrize("case", [c for c in CASES if c.settings_refused is None], ids=lambda c: c.id)
def test_the_corpus_is_answered_as_spec_says(corpus, case):
    failed = [f"{v.subject.id}: {'; '.join(v.problems)}" for v in run(case, corpus) if v.problems]
    assert not failed, f"{case.id} ({case.about}):\n" + "\n".join(failed)


@pytest.mark.parametrize("case", [c for c in CASES if c.settings_refused is not None], ids=lambda c: c.id)
def test_settings_overlapping_a_plugin_mount_are_refused(case):
    assert settings_outcome(case) == {case.settings_refused.reason}


# ---- how the corpus is read: on a tree of its own ----


def test_reading_yaml_markdown_and_go_carriers(tmp_path):
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "two.yaml").write_text(
        "apiVersion: trainer.kubeflow.org/v1alpha1\nkind: TrainingRuntime\nmetadata: {name: rt}\n---\n"
        "apiVersion: trainer.kubeflow.org/v1alpha1\nkind: TrainJob\nmetadata: {name: tj, namespace: ns}\n"
        "spec: {runtimeRef: {name: rt, kind: TrainingRuntime}}\n---\napiVersion: v1\nkind: ConfigMap\n")
    (tmp_path / "guide.md").write_text(
        "text\n\n1. a step:\n\n   ```yaml\n   apiVersion: trainer.kubeflow.org/v1alpha1\n   kind: TrainJob\n"
        "   metadata:\n     name: in-a-list\n   ```\n\n```yaml\nkind: TrainJob\nmetadata: {name: [broken\n```\n")
    (tmp_path / "x_test.go").write_text(
        'package x\nvar s = `apiVersion: trainer.kubeflow.org/v1alpha1\nkind: ClusterTrainingRuntime\n'
        'metadata:\n  name: from-go\n`\n')
    (tmp_path / "notes.txt").write_text("kind: TrainJob\n")
    (tmp_path / "proposals").mkdir()
    (tmp_path / "proposals" / "p.md").write_text("```yaml\nkind: TrainJob\n```\n")
    got = read(tmp_path)
    assert [(d.source, d.where, d.object) for d in got.docs] == [
        ("examples/two.yaml", "doc 1", "TrainingRuntime default/rt"),
        ("examples/two.yaml", "doc 2", "TrainJob ns/tj"),
        ("guide.md", "line 6", "TrainJob default/in-a-list"),
        ("x_test.go", "line 2", "ClusterTrainingRuntime from-go")]
    # The broken block and the text file name the kind but give nothing: looked at, never silently dropped.
    assert got.unread == ("guide.md (line 13)", "notes.txt")
    assert got.read == ("examples/two.yaml", "guide.md", "x_test.go")


def test_a_trainjob_sees_its_own_files_runtimes_over_the_stock_ones(tmp_path):
    head = "apiVersion: trainer.kubeflow.org/v1alpha1\n"
    rt = head + "kind: ClusterTrainingRuntime\nmetadata: {{name: {}}}\nspec: {{x: {}}}\n"
    job = head + "kind: TrainJob\nmetadata: {name: j}\nspec: {runtimeRef: {name: a}}\n"
    (tmp_path / STOCK).mkdir(parents=True)
    (tmp_path / STOCK / "a.yaml").write_text(rt.format("a", "stock"))
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "1.md").write_text("```yaml\n" + rt.format("a", "one") + "---\n" + job + "```\n")
    (tmp_path / "docs" / "2.md").write_text("```yaml\n" + job + "```\n")
    by_file = {s.id.split(" ")[0]: s for s in subjects(read(tmp_path)) if not s.probe}
    assert by_file["docs/1.md"].runtime().obj["spec"] == {"x": "one"}
    assert by_file["docs/2.md"].runtime().obj["spec"] == {"x": "stock"}  # the stock one wins elsewhere
    probes = [s for s in subjects(read(tmp_path)) if s.probe]
    assert [p.runtime().obj["spec"]["x"] for p in probes] == ["one", "stock"]  # each probe names its own


def test_the_upstream_corpus_is_read_once():
    assert corpus_mod.upstream() is corpus_mod.upstream()
