"""Hypothesis strategies for TrainJobs, valid and broken, used by the property and fuzz tests."""

from hypothesis import strategies as st

from tests.helpers import MANAGER

SEGMENTS = st.sampled_from(["opt", "dispatch", "dispatcher", ".", "..", "", "x", "publish", "Dispatch",
                            "d\u0456spatch"])
PATHS = st.lists(SEGMENTS, max_size=5).map(lambda parts: ("/" if parts and parts[0] else "") + "/".join(parts))
NAMES = st.sampled_from(["node", "launcher", "dispatch-publish", "copier", "checkpoint-store", "scratch"])
MANAGERS = st.sampled_from(["example.com/a", "b.io/tuner", "kueue.x-k8s.io/manager", MANAGER])
ENV_NAMES = st.sampled_from(["CKPT", "DISPATCH_X", "PET_NNODES", "PET_MASTER_PORT", "HOME", "dispatch_y"])

mounts = st.fixed_dictionaries({"name": NAMES, "mountPath": PATHS},
                                optional={"readOnly": st.booleans(), "subPath": st.sampled_from(["a", "publish"])})
containers = st.fixed_dictionaries({"name": NAMES}, optional={
    "volumeMounts": st.lists(mounts, max_size=3),
    "env": st.lists(st.fixed_dictionaries({"name": ENV_NAMES, "value": st.text(max_size=5)}), max_size=2),
})
volumes = st.fixed_dictionaries({"name": NAMES}).map(lambda v: {**v, "emptyDir": {}})
pod_specs = st.fixed_dictionaries({}, optional={
    "volumes": st.lists(volumes, max_size=3, unique_by=lambda v: v["name"]),
    "containers": st.lists(containers, max_size=2, unique_by=lambda c: c["name"]),
    "initContainers": st.lists(containers, max_size=2, unique_by=lambda c: c["name"]),
})
entries = st.builds(
    lambda manager, jobs: {"manager": manager, "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
        {"name": name, "template": {"spec": {"template": {"spec": pod}}}} for name, pod in jobs]}}}},
    MANAGERS,
    st.lists(st.tuples(st.sampled_from(["node", "launcher"]), pod_specs), max_size=2, unique_by=lambda t: t[0]),
)


@st.composite
def trainjobs(draw):
    spec = {"runtimeRef": {"name": draw(st.sampled_from(["torch-distributed", "mpi-launcher", "torch-init",
                                                         "missing"]))}}
    if draw(st.booleans()):
        spec["runtimePatches"] = draw(st.lists(entries, max_size=4, unique_by=lambda e: e["manager"]))
    trainer = draw(st.fixed_dictionaries({}, optional={
        "numNodes": st.integers(1, 4), "numProcPerNode": st.integers(1, 8),
        "env": st.lists(st.fixed_dictionaries({"name": ENV_NAMES, "value": st.text(max_size=5)}), max_size=3),
    }))
    if trainer:
        spec["trainer"] = trainer
    if draw(st.booleans()):
        spec["suspend"] = draw(st.booleans())
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
            "metadata": {"name": "fuzz", "namespace": "team-a"}, "spec": spec}
