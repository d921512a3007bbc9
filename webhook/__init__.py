"""dispatch-admission: a mutating and validating admission webhook for Kubeflow Trainer TrainJobs."""

from importlib.metadata import version as _version

# One place for the version: pyproject.toml. The chart's version and appVersion are written from it by
# tools/gen_docs.py (`make docs`), and tests/unit/test_docs.py checks they agree.
__version__ = _version("dispatch-admission")
