"""Hypothesis profiles: CI runs a fixed, reproducible set of examples (derandomized, so CI judges the
change, not the luck of the draw); local runs and the long release run draw new ones each time."""

import os

from hypothesis import settings

# No per-example deadline: under a loaded machine (the whole suite, CI) a slow example is not a failure.
settings.register_profile("ci", derandomize=True, database=None, print_blob=True, deadline=None)
settings.register_profile("dev", print_blob=True, deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))
