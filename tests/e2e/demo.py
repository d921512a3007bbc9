"""`make demo`: the step between `make run` and a production install. The end-to-end harness's cluster (one real
node: containerd, runc, a kubelet, Trainer and JobSet, tests/e2e/node_env.py) with the chart installed from the
image built here, one admitted and one refused TrainJob applied with kubectl, then the cluster left running for
you until Ctrl-C (or SIGTERM), when it is torn down and the host put back as it was.

It needs what the node suites need: root on Linux, Go (the toolchain builds kube-apiserver, the kubelet and the
rest from pinned modules into ~/.cache, once) and BuildKit's build of the image (also from the toolchain).
Nothing here is the harness's copy: it calls the same functions the node suites do.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.e2e import toolchain
from tests.e2e.cluster import ControlPlane
from tests.e2e.helm import CHART, node_values, run_helm
from tests.e2e.image import build_webhook_image
from tests.e2e.node_env import NS, start_trainer_on_node
from tests.helpers import EXAMPLES

RELEASE, RELEASE_NS = "dispatch-admission", "dispatch-system"
ADMITTED = EXAMPLES / "trainjobs" / "admitted-torch.yaml"
REFUSED = EXAMPLES / "trainjobs" / "refused-s3-dispatch-env.yaml"


def say(text: str) -> None:
    print(f"demo: {text}", flush=True)


def apply(cluster: ControlPlane, manifest: Path) -> str:
    """`kubectl apply` of an example, as a user would: its answer, admitted or denied, in kubectl's words."""
    got = cluster.kubectl("apply", "-f", str(manifest), check=False)
    return (got.stdout + got.stderr).strip()


def install(helm: str, kubeconfig: str, values: dict, tmp: Path) -> None:
    run_helm(helm, "install", RELEASE, str(CHART), "--namespace", RELEASE_NS, "--create-namespace", "--wait",
             "--timeout", "5m", values=values, tmp=tmp, kubeconfig=kubeconfig)


def main() -> int:
    if os.geteuid() != 0:
        print("demo: needs root (it runs a kubelet and containerd on this machine, as `make test` does)",
              file=sys.stderr)
        return 2
    started = time.monotonic()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    tmp = Path(tempfile.mkdtemp(prefix="dispatch-demo-"))
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, ignore_errors=True)  # last: the cluster's files, its kubeconfig among them
        say("starting the cluster (etcd, kube-apiserver, containerd, a kubelet, Trainer, JobSet)")
        nc = start_trainer_on_node(stack, tmp)
        kubeconfig = nc.cluster.kubeconfig
        say(f"cluster up ({time.monotonic() - started:.0f}s); building the webhook image")
        image = build_webhook_image(nc.registry)
        helm = str(toolchain.helm_bin() / "helm")
        say(f"helm install {RELEASE} (image {image})")
        stack.callback(run_helm, helm, "uninstall", RELEASE, "--namespace", RELEASE_NS, "--wait", check=False,
                       kubeconfig=kubeconfig)
        install(helm, kubeconfig, node_values(nc.images.publish, image, NS), tmp)
        say(f"installed ({time.monotonic() - started:.0f}s)")
        for manifest in (ADMITTED, REFUSED):
            print(f"$ kubectl apply -f examples/trainjobs/{manifest.name}\n{apply(nc.cluster, manifest)}", flush=True)
        say(f"ready in {time.monotonic() - started:.0f}s. The cluster is yours:\n"
            f"  export KUBECONFIG={kubeconfig}\n"
            f"  {toolchain.kube_bin() / 'kubectl'} get trainjobs -A\n"
            f"Stop it with Ctrl-C (or kill -TERM {os.getpid()}): everything it started is stopped and removed.")
        stop.wait()
        say("stopping")
    return 0


if __name__ == "__main__":
    sys.exit(main())
