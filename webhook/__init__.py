"""dispatch-admission: a mutating and validating admission webhook for Kubeflow Trainer TrainJobs."""

__version__ = "0.1.0"
