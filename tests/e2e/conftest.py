"""Session fixtures: the control plane, Trainer's CRDs, the example runtimes, and our webhook registered by URL;
and the one-node cluster the node suites share (`shared_node`, `node_env`).

Two webhook processes run against the cluster's watch: route 1 (the default) and route 2, chosen per
TrainJob by the label `dispatch-e2e/route: "2"` through the webhook configurations' objectSelector.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e import toolchain
from tests.e2e.cluster import LOGS as _LOGS
from tests.e2e.cluster import ControlPlane, logs_since
from tests.e2e.image import prebuild_webhook_image
from tests.e2e.node_env import NS, NodeEnv, ensure_namespaces, reset_workloads, start_trainer_on_node, webhook_settings
from tests.e2e.webhooks import Webhook, start_our_webhooks
from tests.helpers import EXAMPLES


def pytest_report_header(config):
    # The versions the end-to-end suite builds and runs (the compatibility matrix changes the first two).
    return (f"e2e versions: Kubernetes {toolchain.KUBERNETES}, Trainer {toolchain.TRAINER}, JobSet {toolchain.JOBSET}, "
            f"Kueue {toolchain.KUEUE}, containerd {toolchain.CONTAINERD}, runc {toolchain.RUNC}")


# pytest-xdist (`make test` runs `-n JOBS --dist loadgroup`): the suites that start the one-node cluster (one node
# can exist on a host at a time) are one group, run by one worker one after another; every other file is a group
# of its own, so its module fixtures start once and its tests keep their order; the `env` control plane (a
# session fixture) starts once in each worker that needs it.
# test_two_nodes.py last: it adds a second node to the shared one (node.py's add_node) and takes it away after.
NODE_SUITES = ("test_node.py", "test_verify.py", "test_kueue.py", "test_install.py", "test_two_nodes.py")
# Files whose tests share no module fixture and depend on no order: spread over the workers test by test.
INDEPENDENT = ("test_helm.py", "test_chart_trust.py", "test_chart_docs.py")
LAST = ("test_image.py",)


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the groups (its hook is registered later, so runs first)
def pytest_collection_modifyitems(items):
    for item in items:
        path = Path(str(item.fspath))
        if path.parent.name != "e2e" or path.parent.parent.name != "tests":
            continue
        item.add_marker(pytest.mark.e2e)
        if path.name in NODE_SUITES:
            item.add_marker(pytest.mark.xdist_group("node"))
        elif path.name not in INDEPENDENT:
            item.add_marker(pytest.mark.xdist_group(f"e2e/{path.name}"))
    # The node suites first, one after another: under xdist their group is the longest (most of the run), so
    # it starts on the first worker at once while the others take the rest; without xdist the shared node is up
    # only while they run. In NODE_SUITES' order (a stable sort: each file's own order kept): test_install last,
    # so the webhook image is built while the lighter suites run, and its hostile and memory tests come when the
    # other workers are done (they were first, by the files' names, with the image not built yet).
    # The image's suite last (before the gates, tests/gates/conftest.py): its build, its rebuild from scratch and its
    # scans keep a core busy for two minutes, which at the start slowed the node's own start; handed out last, they
    # run while the node suites' worker waits on the chart's rollouts, with a core to spare.
    on_node = [i for i in items if "tests/e2e/" in str(i.fspath) and Path(str(i.fspath)).name in NODE_SUITES]
    on_node.sort(key=lambda i: NODE_SUITES.index(Path(str(i.fspath)).name))
    last = [i for i in items if "tests/e2e/" in str(i.fspath) and Path(str(i.fspath)).name in LAST]
    if on_node or last:
        chosen = set(on_node + last)
        items[:] = on_node + [i for i in items if i not in chosen] + last


@pytest.fixture(autouse=True)
def _log_offsets(request):
    request.node.stash[_offsets_key] = {name: (p.stat().st_size if p.exists() else 0) for name, p in _LOGS.items()}
    yield


_offsets_key = pytest.StashKey[dict]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed and item.stash.get(_offsets_key, None) is not None:
        for name, offset in item.stash[_offsets_key].items():
            text = logs_since(_LOGS[name], offset)
            if text:
                report.sections.append((f"{name} log during this test", text[-20000:]))
    return report


@dataclass
class Env:
    cluster: ControlPlane
    route1: Webhook
    route2: Webhook


def start_cluster(stack: contextlib.ExitStack, tmp: Path, crds: list[Path], suffix: str = "") -> ControlPlane:
    """etcd and kube-apiserver (stopped with the stack), the CRDs installed, namespace team-a made."""
    cluster = ControlPlane(tmp / "control-plane")
    stack.callback(cluster.stop)
    _LOGS[f"etcd{suffix}"] = cluster.etcd_log
    _LOGS[f"kube-apiserver{suffix}"] = cluster.apiserver_log
    cluster.start()
    cluster.install_crds(crds)
    cluster.kubectl("create", "namespace", "team-a")
    return cluster


@pytest.fixture(scope="module")
def helm():
    """The helm binary (test_helm, test_chart_trust and test_trust)."""
    return str(toolchain.helm_bin() / "helm")


@pytest.fixture(scope="session")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    with contextlib.ExitStack() as stack:
        cluster = start_cluster(stack, tmp, toolchain.trainer_crds())
        for f in sorted((EXAMPLES / "runtimes").glob("*.yaml")):
            cluster.kubectl("apply", "-f", str(f))
        yield Env(cluster, *start_our_webhooks(stack, cluster, tmp))


# ---- the one-node cluster of the node suites (test_node, test_verify, test_kueue, test_install) ----

NODE_NICE = -5  # the node suites' share of a contended CPU: weight 3121 to the other workers' 1024 (sched(7))


@contextlib.contextmanager
def first_on_the_cpu(nice: int = NODE_NICE):
    """This thread, and every process and thread it starts meanwhile (the node's servers, its pods, helm and
    kubectl), scheduled before the other workers' when both want a core. The node suites are the run's longest
    chain (docs/development.md), mostly waiting on the node; the other workers' tests fill the cores around it
    rather than slow it. Linux's nice is per thread and inherited; lowering it needs root, as the node does."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, before + nice)
    except PermissionError:
        yield before
        return
    try:
        yield before  # what work started here but not on the chain should run at
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, before)


@pytest.fixture(scope="session")
def shared_node(request, tmp_path_factory):
    """The one-node cluster, started once for the node suites (tests/e2e/node_env.py says what it holds); each
    suite's module fixture adds its own and resets the node after itself. When test_install runs in this session,
    the webhook image is built and pushed to the node's registry meanwhile (its fixture then finds it there)."""
    tmp = tmp_path_factory.mktemp("node")
    with contextlib.ExitStack() as stack:
        others = stack.enter_context(first_on_the_cpu())
        nc = start_trainer_on_node(stack, tmp)
        chart_suites = ("test_install.py", "test_two_nodes.py")
        if any(Path(str(item.fspath)).name in chart_suites for item in request.session.items):
            # At the other workers' priority: the node's start comes first. Not left running past the node.
            stack.callback(prebuild_webhook_image(nc.registry, nice=others).join)
        yield nc
        if nc.owed:  # no suite comes after: the node's teardown takes these with it
            print(f"\nowed to the node, dropped with it: {'; '.join(what for what, _ in nc.owed)}")
            nc.owed.clear()
    assert not nc.node.problems, f"the node's teardown left: {nc.node.problems}"


@pytest.fixture(scope="module")
def node_env(shared_node, tmp_path_factory):
    """test_node's and test_verify's: our webhook as two processes on the shared node (settings naming the publish
    image the harness pushed) and namespace team-q; the node reset after the module."""
    nc = shared_node
    nc.settle()
    c = nc.cluster
    tmp = tmp_path_factory.mktemp("node-env")
    ensure_namespaces(c, "team-q")
    with contextlib.ExitStack() as stack:
        hooks = start_our_webhooks(stack, c, tmp, " (node)", webhook_settings(tmp, nc.images))
        stack.callback(reset_workloads, c, (NS, "team-q"))  # before the webhook processes stop
        yield NodeEnv(nc, c, nc.images, hooks[0], hooks[1], tmp)
