"""The chart's alerts and Grafana dashboard.

The rules file under test is the one the chart renders (taken from `helm template`, so chart and tests cannot
drift). `promtool check rules` validates it and `promtool test rules` runs unit tests over synthetic series:
each alert fires where it should and stays quiet where it should not. promtool is built from the
github.com/prometheus/prometheus module like the other binaries. The dashboard's queries and the alerts'
expressions may name only metrics the server defines (read from webhook/process/metrics.py) and, for the replica
alert, kube-state-metrics' Deployment status.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.e2e import toolchain
from tests.e2e.helm import BASE, CHART, FULL, NS, merged, run_helm
from tests.helpers import ROOT

SERIES = f'job="{FULL}",namespace="{NS}"'  # what a ServiceMonitor's scrape of this release's pods carries
POD = 'pod="rel-dispatch-admission-6d5f-abcde",instance="10.1.0.7:8080"'
POD_LABELS = {"pod": "rel-dispatch-admission-6d5f-abcde", "instance": "10.1.0.7:8080"}
OTHER = 'job="other-release",namespace="elsewhere"'  # another release's series: never ours to alert on
KSM_METRICS = {"kube_deployment_status_replicas_available"}


@pytest.fixture(scope="module")
def helm():
    return str(toolchain.helm_bin() / "helm")


@pytest.fixture(scope="module")
def promtool():
    return str(toolchain.promtool_bin() / "promtool")


def rendered_rules(helm, tmp: Path, values: dict | None = None) -> dict:
    out = run_helm(helm, "template", "rel", str(CHART), "--namespace", NS, tmp=tmp,
                   values=merged(BASE, {"prometheusRule": {"enabled": True}}, values or {})).stdout
    (rule,) = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "PrometheusRule"]
    return {"groups": rule["spec"]["groups"]}


def write_rules(helm, tmp: Path, values: dict | None = None, name: str = "rules.yaml") -> Path:
    path = tmp / name
    path.write_text(yaml.safe_dump(rendered_rules(helm, tmp, values), sort_keys=False))
    return path


def alert_rules(rules: dict) -> dict[str, dict]:
    return {r["alert"]: r for g in rules["groups"] for r in g["rules"] if "alert" in r}


# ---- expected annotations: the rule's own templates, expanded for the labels and value a test expects ----

def expand(template: str, labels: dict, value: str) -> str:
    """Expand the few template forms the rules use; anything else is a test to update, not to guess."""
    def with_label(m):
        return f"{labels[m.group(1)]}{m.group(2)}" if labels.get(m.group(1)) else ""
    out = re.sub(r"\{\{ with \$labels\.(\w+) \}\}\{\{ \. \}\}(.*?)\{\{ end \}\}", with_label, template)
    out = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m.group(1), ""), out)
    out = re.sub(r"\{\{ \$value \| (humanize|humanizeDuration) \}\}", lambda m: value, out)
    assert "{{" not in out, f"a template form the test does not expand: {out}"
    return out


def firing(rule: dict, labels: dict, value: str = "") -> dict:
    """One expected alert of `rule`: its labels (the series' by-labels plus the rule's) and expanded annotations."""
    all_labels = {**labels, **rule.get("labels", {})}
    return {"exp_labels": all_labels,
            "exp_annotations": {k: expand(v, all_labels, value) for k, v in rule["annotations"].items()}}


# ---- the unit tests, per alert: (name, input series, [(eval time, expected alerts or [])]) ----

def unit_tests(rules: dict) -> list[dict]:
    a = alert_rules(rules)
    ns = {"namespace": NS}
    tests = []

    def add(alert, name, series, checks):
        tests.append({"name": f"{alert}: {name}", "interval": "1m",
                      "input_series": [{"series": s, "values": v} for s, v in series],
                      "alert_rule_test": [{"eval_time": t, "alertname": alert,
                                           "exp_alerts": exp} for t, exp in checks]})

    # No available replica (kube-state-metrics' Deployment status).
    r = a["DispatchAdmissionNoReadyReplica"]
    dep = {"namespace": NS, "deployment": FULL, "job": "kube-state-metrics"}
    add(r["alert"], "fires 2m after the last replica goes",
        [(f'kube_deployment_status_replicas_available{{namespace="{NS}",deployment="{FULL}",job="kube-state-metrics"}}',
          "2 2 2 0 0 0 0 0 0 0")],
        [("2m", []), ("4m", []), ("6m", [firing(r, dep)])])
    add(r["alert"], "quiet while a replica is available, and for other Deployments",
        [(f'kube_deployment_status_replicas_available{{namespace="{NS}",deployment="{FULL}"}}', "2 1 1 1 1 1 1 1 1 1"),
         (f'kube_deployment_status_replicas_available{{namespace="{NS}",deployment="something-else"}}', "0x10")],
        [("9m", [])])

    # p99 latency above half of webhook.timeoutSeconds (10s: 5s).
    r = a["DispatchAdmissionSlowReviews"]

    def histogram(sel, slow):
        # 60 reviews a minute; slow: all between 5s and 10s (p99 9.95s); fast: all under 10ms.
        buckets = {"0.01": "0x30" if slow else "0+60x30", "5": "0x30" if slow else "0+60x30",
                   "10": "0+60x30", "+Inf": "0+60x30"}
        return [(f'dispatch_admission_review_seconds_bucket{{{sel},endpoint="validate",le="{le}"}}', v)
                for le, v in buckets.items()]
    add(r["alert"], "fires after 10m of p99 above 5s",
        histogram(f"{SERIES},{POD}", slow=True),
        [("8m", []), ("20m", [firing(r, {"endpoint": "validate"}, "9.95")])])
    add(r["alert"], "quiet when fast, and for another release",
        histogram(f"{SERIES},{POD}", slow=False) + histogram(OTHER, slow=True),
        [("25m", [])])

    # ErrUnavailable or ErrInternal answers.
    r = a["DispatchAdmissionErrors"]
    add(r["alert"], "fires on ErrUnavailable answers",
        [(f'dispatch_admission_reviews_total{{{SERIES},{POD},endpoint="validate",outcome="denied",sentinel="ErrUnavailable"}}',
          "0 0 0 0 0 0 3 3 3 3 3 3 3 3 3 3 3 3 3 3 3 3 3 3 3 3 3 3 3 3")],
        [("5m", []), ("6m", [firing(r, {"endpoint": "validate", "sentinel": "ErrUnavailable"}, "3")]),
         ("29m", [])])
    add(r["alert"], "quiet on rule denials and on other releases' faults",
        [(f'dispatch_admission_reviews_total{{{SERIES},{POD},endpoint="validate",outcome="denied",sentinel="ErrInvalid"}}',
          "0+5x30"),
         (f'dispatch_admission_reviews_total{{{SERIES},{POD},endpoint="mutate",outcome="allowed",sentinel=""}}',
          "0+50x30"),
         (f'dispatch_admission_reviews_total{{{OTHER},endpoint="validate",outcome="denied",sentinel="ErrInternal"}}',
          "0+5x30")],
        [("15m", [])])

    # The runtime cache not synced.
    r = a["DispatchAdmissionRuntimeCacheNotSynced"]
    add(r["alert"], "fires after 5m unsynced",
        [(f'dispatch_admission_runtime_cache_synced{{{SERIES},{POD},kind="ClusterTrainingRuntime"}}', "0x10"),
         (f'dispatch_admission_runtime_cache_synced{{{SERIES},{POD},kind="TrainingRuntime"}}', "1x10")],
        [("3m", []), ("6m", [firing(r, {**ns, **POD_LABELS, "kind": "ClusterTrainingRuntime"})])])
    add(r["alert"], "quiet once synced within 5m",
        [(f'dispatch_admission_runtime_cache_synced{{{SERIES},{POD},kind="ClusterTrainingRuntime"}}',
          "0 0 0 1 1 1 1 1 1 1 1"),
         (f'dispatch_admission_runtime_cache_synced{{{OTHER},kind="ClusterTrainingRuntime"}}', "0x10")],
        [("10m", [])])

    # The runtime cache not confirmed current (its keeper down, or its watch stuck): the age grows a minute a minute.
    r = a["DispatchAdmissionRuntimeCacheStale"]
    add(r["alert"], "fires 5m after the age passes 600s",
        [(f'dispatch_admission_runtime_cache_age_seconds{{{SERIES},{POD},kind="TrainingRuntime"}}', "300+60x20"),
         (f'dispatch_admission_runtime_cache_age_seconds{{{SERIES},{POD},kind="ClusterTrainingRuntime"}}', "30x20")],
        [("8m", []), ("11m", [firing(r, {**ns, **POD_LABELS, "kind": "TrainingRuntime"}, "16m 0s")])])
    add(r["alert"], "quiet while bookmarks keep it young, and for other releases",
        [(f'dispatch_admission_runtime_cache_age_seconds{{{SERIES},{POD},kind="TrainingRuntime"}}',
          "0 60 120 0 60 120 0 60 120 0 60 120 0 60 120 0 60 120 0 60"),
         (f'dispatch_admission_runtime_cache_age_seconds{{{OTHER},kind="TrainingRuntime"}}', "3000+60x20")],
        [("19m", [])])

    # The runtime keeper restarting.
    r = a["DispatchAdmissionRuntimeKeeperRestarting"]
    add(r["alert"], "fires on a third start within 30m",
        [(f'dispatch_admission_runtime_keeper_starts_total{{{SERIES},{POD}}}', "1 1 2 2 3 3 4 4 4 4 4 4")],
        [("3m", []), ("6m", [firing(r, {**ns, **POD_LABELS}, "3")])])
    add(r["alert"], "quiet on one restart, and for other releases",
        [(f'dispatch_admission_runtime_keeper_starts_total{{{SERIES},{POD}}}', "1 1 1 2 2 2 2 2 2 2"),
         (f'dispatch_admission_runtime_keeper_starts_total{{{OTHER}}}', "1+1x10")],
        [("9m", [])])

    # The keeper's lists, watches, reads or writes failing.
    r = a["DispatchAdmissionRuntimeKeeperErrors"]
    add(r["alert"], "fires on errors that last",
        [(f'dispatch_admission_runtime_keeper_errors_total{{{SERIES},{POD},operation="list/watch",kind="TrainingRuntime"}}',
          "0+1x40")],
        [("10m", []), ("31m", [firing(r, {**ns, **POD_LABELS, "operation": "list/watch", "kind": "TrainingRuntime"},
                                      "15")])])
    add(r["alert"], "quiet on a few reconnects, and for other releases",
        [(f'dispatch_admission_runtime_keeper_errors_total{{{SERIES},{POD},operation="list/watch",kind="TrainingRuntime"}}',
          "0 1 1 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2"),
         (f'dispatch_admission_runtime_keeper_errors_total{{{OTHER},operation="get",kind="TrainingRuntime"}}',
          "0+9x40")],
        [("39m", [])])

    # Live reads refused over the pod's limit.
    r = a["DispatchAdmissionLiveReadsLimited"]
    add(r["alert"], "fires on limited or busy live reads",
        [(f'dispatch_admission_runtime_live_reads_total{{{SERIES},{POD},outcome="limited"}}',
          "0 0 0 0 0 50 100 100 100 100"),
         (f'dispatch_admission_runtime_live_reads_total{{{SERIES},{POD},outcome="found"}}', "0+3x10")],
        [("4m", []), ("7m", [firing(r, {**ns, **POD_LABELS}, "100")])])
    add(r["alert"], "quiet on live reads within the limit, and for other releases",
        [(f'dispatch_admission_runtime_live_reads_total{{{SERIES},{POD},outcome="missing"}}', "0+20x10"),
         (f'dispatch_admission_runtime_live_reads_total{{{OTHER},outcome="limited"}}', "0+20x10")],
        [("9m", [])])

    # A certificate expiring within 14 days (promtool's clock starts at Unix time 0).
    r = a["DispatchAdmissionCertificateExpiring"]
    thirteen_days, thirty_days = 13 * 86400, 30 * 86400
    add(r["alert"], "fires when 13 days are left, after 1h",
        [(f'dispatch_admission_certificate_not_after_seconds{{{SERIES},{POD},certificate="serving"}}',
          f"{thirteen_days}x150"),
         (f'dispatch_admission_certificate_not_after_seconds{{{SERIES},{POD},certificate="ca"}}',
          f"{thirty_days * 10}x150")],
        [("30m", []), ("2h", [firing(r, {**ns, **POD_LABELS, "certificate": "serving"}, "12d 22h 0m 0s")])])
    add(r["alert"], "quiet with 30 days left",
        [(f'dispatch_admission_certificate_not_after_seconds{{{SERIES},{POD},certificate="serving"}}',
          f"{thirty_days}x150"),
         (f'dispatch_admission_certificate_not_after_seconds{{{OTHER},certificate="serving"}}', "0x150")],
        [("2h", [])])

    # A runtime that cannot carry the mount (the runtime's namespace label becomes exported_namespace under a
    # ServiceMonitor, whose target label `namespace` is the webhook's; a ClusterTrainingRuntime has none).
    r = a["DispatchAdmissionRuntimeCannotCarryMount"]
    pod2 = 'pod="rel-dispatch-admission-6d5f-fghij",instance="10.1.0.8:8080"'
    if "runtimes_cannot_carry" in r["expr"]:  # the default: counts per kind, no runtime named (metrics.runtimeLabels)
        add(r["alert"], "fires per kind while every replica counts an unfit runtime",
            [(f'dispatch_admission_runtimes_cannot_carry{{{SERIES},{POD},kind="TrainingRuntime"}}', "2x10"),
             (f'dispatch_admission_runtimes_cannot_carry{{{SERIES},{pod2},kind="TrainingRuntime"}}', "1x10"),
             (f'dispatch_admission_runtimes_cannot_carry{{{SERIES},{POD},kind="ClusterTrainingRuntime"}}', "0x10")],
            [("4m", []), ("6m", [firing(r, {**ns, "kind": "TrainingRuntime"}, "1")])])
        add(r["alert"], "quiet when fit, fixed, seen by one replica only, or another release's",
            [(f'dispatch_admission_runtimes_cannot_carry{{{SERIES},{POD},kind="ClusterTrainingRuntime"}}', "0x10"),
             (f'dispatch_admission_runtimes_cannot_carry{{{SERIES},{POD},kind="TrainingRuntime"}}',
              "1 1 1 0 0 0 0 0 0 0"),
             (f'dispatch_admission_runtimes_cannot_carry{{{SERIES},{pod2},kind="TrainingRuntime"}}', "0x10"),
             (f'dispatch_admission_runtimes_cannot_carry{{{OTHER},kind="ClusterTrainingRuntime"}}', "3x10")],
            [("9m", [])])
        return _rest(tests, a, add, ns)
    add(r["alert"], "fires for each runtime every replica finds unfit",
        [(f'dispatch_admission_runtime_ready{{{SERIES},{POD},kind="TrainingRuntime",'
          f'exported_namespace="team-a",name="torch-team"}}', "0x10"),
         (f'dispatch_admission_runtime_ready{{{SERIES},{pod2},kind="TrainingRuntime",'
          f'exported_namespace="team-a",name="torch-team"}}', "0x10"),
         (f'dispatch_admission_runtime_ready{{{SERIES},{POD},kind="ClusterTrainingRuntime",name="no-node"}}', "0x10"),
         (f'dispatch_admission_runtime_ready{{{SERIES},{POD},kind="ClusterTrainingRuntime",name="torch-distributed"}}',
          "1x10")],
        [("4m", []),
         ("6m", [firing(r, {**ns, "kind": "TrainingRuntime", "exported_namespace": "team-a", "name": "torch-team"}),
                 firing(r, {**ns, "kind": "ClusterTrainingRuntime", "name": "no-node"})])])
    add(r["alert"], "quiet for runtimes that can carry it, fixed ones, and other releases",
        [(f'dispatch_admission_runtime_ready{{{SERIES},{POD},kind="ClusterTrainingRuntime",name="torch-distributed"}}',
          "1x10"),
         (f'dispatch_admission_runtime_ready{{{SERIES},{POD},kind="ClusterTrainingRuntime",name="fixed"}}',
          "0 0 0 1 1 1 1 1 1 1"),
         (f'dispatch_admission_runtime_ready{{{OTHER},kind="ClusterTrainingRuntime",name="no-node"}}', "0x10")],
        [("9m", [])])
    return _rest(tests, a, add, ns)


def _rest(tests, a, add, ns) -> list[dict]:
    # The latest settings refused (SPEC 2.1): the last good ones are kept.
    r = a["DispatchAdmissionSettingsInvalid"]
    add(r["alert"], "fires 1m after a replica refuses its settings",
        [(f'dispatch_admission_settings_valid{{{SERIES},{POD}}}', "1 1 1 0 0 0 0 0 0 0")],
        [("3m", []), ("5m", [firing(r, {**ns, **POD_LABELS})])])
    add(r["alert"], "quiet with good settings, a bad edit fixed within the minute, and other releases",
        [(f'dispatch_admission_settings_valid{{{SERIES},{POD}}}', "1 1 0 1 1 1 1 1 1 1"),
         (f'dispatch_admission_settings_valid{{{OTHER}}}', "0x10")],
        [("9m", [])])

    # A settings switch (issue 35): told for 10 minutes, per namespace however many replicas and workers switched.
    r = a["DispatchAdmissionSettingsSwitched"]
    add(r["alert"], "fires at once on a switch, for 10 minutes",
        [(f'dispatch_admission_settings_switches_total{{{SERIES},{POD}}}', "0 0 0 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2 2"),
         (f'dispatch_admission_settings_switches_total{{{SERIES},pod="other-pod"}}', "0 0 0 0 2 2 2 2 2 2 2 2 2 2 2")],
        [("2m", []), ("4m", [firing(r, ns)]), ("12m", [firing(r, ns)]), ("16m", [])])
    add(r["alert"], "quiet while the settings stay, across a pod restart, and for other releases",
        [(f'dispatch_admission_settings_switches_total{{{SERIES},{POD}}}', "3 3 3 3 0 0 0 0 0 0"),
         (f'dispatch_admission_settings_switches_total{{{OTHER}}}', "0+1x10")],
        [("9m", [])])

    # Would-deny in warn mode.
    r = a["DispatchAdmissionWouldDeny"]
    add(r["alert"], "fires on would-deny counts",
        [(f'dispatch_admission_would_deny_total{{{SERIES},{POD},sentinel="ErrUnsupported",rule="R3"}}',
          "0 0 0 0 0 0 2 2 2 2 2 2")],
        [("5m", []), ("10m", [firing(r, {"sentinel": "ErrUnsupported", "rule": "R3"}, "2")])])
    add(r["alert"], "quiet under enforce (the counter never moves) and for other releases",
        [(f'dispatch_admission_would_deny_total{{{SERIES},{POD},sentinel="ErrInvalid",rule="S2"}}', "0x20"),
         (f'dispatch_admission_would_deny_total{{{OTHER},sentinel="ErrInvalid",rule="S2"}}', "0+1x20")],
        [("20m", [])])
    return tests


def write_unit_tests(tmp: Path, rules_file: Path, rules: dict, name="tests.yaml") -> Path:
    path = tmp / name
    path.write_text(yaml.safe_dump({"rule_files": [rules_file.name], "evaluation_interval": "1m",
                                    "tests": unit_tests(rules)}, sort_keys=False))
    return path


def promtool_run(promtool, *args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=300, cwd=cwd)


# ---- the tests ----

def test_promtool_checks_the_rendered_rules(helm, promtool, tmp_path):
    rules = write_rules(helm, tmp_path)
    got = promtool_run(promtool, "check", "rules", str(rules), cwd=tmp_path)
    count = len(alert_rules(yaml.safe_load(rules.read_text())))  # every alert of values.yaml, on by default
    assert count == len(yaml.safe_load((CHART / "values.yaml").read_text())["prometheusRule"]["alerts"])
    assert got.returncode == 0 and f"SUCCESS: {count} rules found" in got.stdout, got.stdout + got.stderr


@pytest.mark.parametrize("runtime_labels", [False, True], ids=["counts", "runtime-labels"])
def test_every_alert_fires_and_stays_quiet_as_it_should(helm, promtool, tmp_path, runtime_labels):
    rules_file = write_rules(helm, tmp_path, {"metrics": {"runtimeLabels": runtime_labels}})
    rules = yaml.safe_load(rules_file.read_text())
    tests = write_unit_tests(tmp_path, rules_file, rules)
    got = promtool_run(promtool, "test", "rules", str(tests), cwd=tmp_path)
    assert got.returncode == 0 and "SUCCESS" in got.stdout, got.stdout + got.stderr


def test_each_alert_has_a_firing_and_a_quiet_unit_test(helm, tmp_path):
    rules = rendered_rules(helm, tmp_path)
    names = set(alert_rules(rules))
    assert len(names) == len(yaml.safe_load((CHART / "values.yaml").read_text())["prometheusRule"]["alerts"])
    fires, quiet = set(), set()
    for test in unit_tests(rules):
        for check in test["alert_rule_test"]:
            (fires if check["exp_alerts"] else quiet).add(check["alertname"])
    assert fires == names and quiet == names


def test_the_unit_tests_catch_broken_thresholds(helm, promtool, tmp_path):
    """Rendered with other thresholds, the same unit tests fail: they test the thresholds, not just syntax."""
    broken = {"webhook": {"timeoutSeconds": 30},  # p99 9.95s is then below 15s
              "prometheusRule": {"alerts": {"certificateExpiry": {"days": 1}, "admissionErrors": {"threshold": 5},
                                            "wouldDeny": {"threshold": 5}, "cacheStale": {"seconds": 3600},
                                            "keeperRestarts": {"threshold": 5}}}}
    good = rendered_rules(helm, tmp_path)
    rules_file = write_rules(helm, tmp_path, broken, name="broken.yaml")
    tests = write_unit_tests(tmp_path, rules_file, good, name="broken-tests.yaml")
    got = promtool_run(promtool, "test", "rules", str(tests), cwd=tmp_path)
    assert got.returncode != 0
    for alert in ("DispatchAdmissionSlowReviews", "DispatchAdmissionCertificateExpiring", "DispatchAdmissionErrors",
                  "DispatchAdmissionWouldDeny", "DispatchAdmissionRuntimeCacheStale",
                  "DispatchAdmissionRuntimeKeeperRestarting"):
        assert f"alertname: {alert}" in got.stdout + got.stderr, got.stdout + got.stderr


def test_alerts_can_be_turned_off_and_retuned(helm, tmp_path):
    rules = rendered_rules(helm, tmp_path, {"prometheusRule": {
        "selector": 'service="x"', "alerts": {"wouldDeny": {"enabled": False},
                                             "slowReviews": {"thresholdSeconds": 2.5, "for": "3m",
                                                             "severity": "page"}}}})
    a = alert_rules(rules)
    every = len(yaml.safe_load((CHART / "values.yaml").read_text())["prometheusRule"]["alerts"])
    assert "DispatchAdmissionWouldDeny" not in a and len(a) == every - 1
    slow = a["DispatchAdmissionSlowReviews"]
    assert slow["expr"].endswith("> 2.5") and slow["for"] == "3m" and slow["labels"] == {"severity": "page"}
    assert '{service="x"}' in slow["expr"]


def test_every_alert_says_what_to_do(helm, tmp_path):
    for name, rule in alert_rules(rendered_rules(helm, tmp_path)).items():
        assert set(rule["annotations"]) == {"summary", "description"}, name
        assert len(rule["annotations"]["description"]) > 150, name
        assert rule["labels"]["severity"], name


# ---- metric names: only what the server defines ----

def exported_metric_names() -> set[str]:
    """The series names webhook/process/metrics.py defines, read from its source (Counter, Gauge, Histogram, and the
    metric families its collector yields), with the suffixes prometheus_client exports for each type."""
    tree = ast.parse((ROOT / "webhook" / "process" / "metrics.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)):
            continue
        func = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
        name = node.args[0].value
        if func in ("Counter", "CounterMetricFamily"):
            base = name.removesuffix("_total")
            names |= {base + "_total", base + "_created"}
        elif func in ("Histogram", "HistogramMetricFamily"):
            names |= {name + s for s in ("_bucket", "_count", "_sum", "_created")}
        elif func in ("Gauge", "GaugeMetricFamily"):
            names.add(name)
    return names


KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset",
            "inf", "nan", "Inf", "NaN"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions, keywords, label
    names in matchers or groupings, durations, or Grafana variables."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)                                       # string literals
    s = re.sub(r"\$\{[^}]*\}|\$\w+", "", s)                                             # Grafana variables
    s = re.sub(r"\{[^}]*\}", "", s)                                                     # label matchers
    s = re.sub(r"\[[^\]]*\]", "", s)                                                    # ranges
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", s)  # groupings
    names = set()
    for m in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", s):
        if s[m.end():].lstrip().startswith("(") or m.group(0) in KEYWORDS:
            continue
        names.add(m.group(0))
    return names


def test_metric_name_parser():
    expr = 'histogram_quantile(0.99, sum by (le, endpoint) (rate(a_bucket{job="x",le!="1"}[5m])))'
    assert metric_names(expr) == {"a_bucket"}
    assert metric_names('time() - max by (kind) (b{job="$job"}) / 86400 and on (kind) c offset 5m') == {"b", "c"}
    assert metric_names('sum(rate(d_total{x=~"a|b"}[$__rate_interval])) by (code) > bool 0') == {"d_total"}


def test_the_server_defines_the_contract_metrics():
    names = exported_metric_names()
    for name in ("dispatch_admission_reviews_total", "dispatch_admission_review_seconds_bucket",
                 "dispatch_admission_bad_requests_total", "dispatch_admission_would_deny_total",
                 "dispatch_admission_runtime_ready", "dispatch_admission_runtimes_cannot_carry",
                 "dispatch_admission_runtime_cache_synced",
                 "dispatch_admission_runtime_cache_size",
                 "dispatch_admission_runtime_cache_last_sync_timestamp_seconds",
                 "dispatch_admission_certificate_not_after_seconds", "dispatch_admission_api_requests_total",
                 "dispatch_admission_api_errors_total", "dispatch_admission_settings_valid",
                 "dispatch_admission_runtime_cache_age_seconds", "dispatch_admission_runtime_keeper_starts_total",
                 "dispatch_admission_runtime_keeper_errors_total", "dispatch_admission_runtime_live_reads_total"):
        assert name in names, name


@pytest.mark.parametrize("runtime_labels", [False, True], ids=["counts", "runtime-labels"])
def test_alerts_name_only_metrics_the_server_exports(helm, tmp_path, runtime_labels):
    exported = exported_metric_names()
    for name, rule in alert_rules(rendered_rules(helm, tmp_path,
                                                 {"metrics": {"runtimeLabels": runtime_labels}})).items():
        used = metric_names(rule["expr"])
        assert used, name
        assert used <= exported | KSM_METRICS, (name, used - exported)


def _dashboard(helm, tmp_path) -> dict:
    out = run_helm(helm, "template", "rel", str(CHART), "--namespace", NS, tmp=tmp_path,
                   values=merged(BASE, {"grafanaDashboard": {"enabled": True,
                                                             "annotations": {"grafana_folder": "ML"}}})).stdout
    (cm,) = [d for d in yaml.safe_load_all(out)
             if d and d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "ML"}
    (text,) = cm["data"].values()
    return json.loads(text)


def _queries(dashboard: dict) -> list[str]:
    exprs = []
    for panel in dashboard["panels"]:
        exprs += [t["expr"] for t in panel.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", var["query"]["query"]))
    return exprs


def test_dashboard_queries_name_only_metrics_the_server_exports(helm, tmp_path):
    dashboard = _dashboard(helm, tmp_path)
    exported = exported_metric_names()
    queries = _queries(dashboard)
    assert len(queries) >= 12
    used = set()
    for q in queries:
        names = metric_names(q)
        assert names, q
        assert names <= exported, (q, names - exported)
        used |= names
    # The dashboard covers every family the server exports (bar the _created/_count/_sum helpers).
    families = {n for n in exported if not n.endswith(("_created", "_count", "_sum"))}
    assert not families - used, families - used


def test_dashboard_panels_are_well_formed(helm, tmp_path):
    dashboard = _dashboard(helm, tmp_path)
    assert dashboard["uid"] == "dispatch-admission" and dashboard["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert all(t["refId"] for t in panel["targets"])
