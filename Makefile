# Two commands do all the set-up on a fresh clone:
#   make run    install, then serve locally on https://127.0.0.1:8443 (example settings, local CA in certs/)
#   make test   install, build the end-to-end binaries (cached), run every test
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# pytest-xdist workers for `make test`, `make unit` and `make e2e` (`make test JOBS=1`: one process, no xdist).
# More workers than cores pays: the end-to-end tests mostly wait on API servers and pods. Groups keep what must
# stay together on one worker (tests/conftest.py, tests/e2e/conftest.py: the one-node suites, each file's module
# fixtures).
JOBS ?= 4
XDIST := $(if $(filter-out 0 1,$(JOBS)),-n $(JOBS) --dist loadgroup)

.PHONY: install run test test-extra test-compat unit e2e toolchain toolchain-extra wrk bench bench-cluster bench-kyverno \
	sweep clean lock docs lint demo dist \
	docs-check serve-docs

# uv resolves and installs the package and its extras (10 s from its cache, where pip took 43 s); pip only
# installs uv, and stays in the venv for `make lock`. --compile-bytecode, as pip does by default: uv writes no .pyc,
# and where PYTHONDONTWRITEBYTECODE is set every process compiled its imports again (bench/cluster.py's pod:
# 128-130 MiB PSS and ready in 3 s at 10,000 runtimes, 121 MiB and 2 s with the bytecode).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet 'uv>=0.5'
	$(VENV)/bin/uv pip install --quiet --compile-bytecode --python $(PY) -e '.[test,docs]'
	touch $@

install: $(VENV)/.installed

run: install
	$(VENV)/bin/dispatch-admission serve --dev

# The step between `make run` and a production install: the end-to-end harness's one-node cluster (root, Go) with
# Trainer and the chart installed from the image built here; one admitted and one refused TrainJob; left running
# until Ctrl-C (tests/e2e/demo.py).
demo: install toolchain
	$(PY) -m tests.e2e.demo

# Builds kube-apiserver, kubectl, etcd and helm from pinned Go modules into ~/.cache (once per version).
toolchain: install
	$(PY) -m tests.e2e.toolchain

# What only `make test-extra` needs: Kyverno's admission controller and cosign (~15 min to build cold on 2 cores).
toolchain-extra: install
	$(PY) -m tests.e2e.toolchain kyverno cosign

# Not in `make test` (CI keeps it well inside 90 minutes from empty caches): the comparisons with other engines
# (our rules as Kyverno policies and as in-tree admission policies, on one API server) and the signed multi-arch
# image (cosign, the arm64 half run under qemu-user). `make test-extra` runs them.
EXTRA_TESTS ?= tests/e2e/test_kyverno.py tests/e2e/test_cel_policies.py tests/e2e/test_signed_image.py

# The soak test and the benchmark drive the server with wrk (Debian's package).
wrk:
	@command -v wrk >/dev/null || { apt-get update -qq && apt-get install -y -qq wrk >/dev/null; }

# Lint and types (ruff on the whole repository; mypy on the package, strict on webhook.core; seconds).
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy webhook

# Every test in parallel on JOBS workers (lint, types, the docs check and the rule sweep among them:
# tests/gates), then the `timing` tests alone (their bounds compare latencies under a flood with a quiet run,
# which other workers' load would blur).
test: install toolchain wrk
	$(PY) -m pytest $(XDIST) -m "not timing" $(addprefix --ignore=,$(EXTRA_TESTS)) --durations=25 $(PYTEST_ARGS)
	$(PY) -m pytest -m timing $(addprefix --ignore=,$(EXTRA_TESTS)) $(PYTEST_ARGS)

test-extra: install toolchain toolchain-extra wrk
	$(PY) -m pytest $(EXTRA_TESTS) $(PYTEST_ARGS)

# The reference pages, the chart's README (helm-docs) and the chart's version, generated from the code.
docs: install
	$(PY) tools/gen_docs.py

# Fails when a generated page differs from the code, or the site has a broken link or a page out of the nav.
# (tests/unit/test_docs.py checks the generated pages inside pytest too.) No --quiet: it hides the warnings
# that --strict counts, and the build then passes.
docs-check: install
	$(PY) tools/gen_docs.py --check
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir $(VENV)/docs-site

# The site on http://127.0.0.1:8000, rebuilt on every change.
serve-docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8000

# The compatibility matrix (issue 22), not part of `make test`: the API-level suite (our webhooks beside
# Trainer's, and every rule through kubectl: COMPAT_TESTS) once per other Trainer and Kubernetes release, each built from its Go
# module and cached like the defaults (a Kubernetes build takes ~7 min on 2 cores). Every run goes ahead even
# when one fails; the target fails if any did.
COMPAT_TRAINERS ?= v2.2.1
COMPAT_KUBERNETES ?= v1.35.4 v1.36.3
COMPAT_TESTS ?= tests/e2e/test_trainer.py tests/e2e/test_kubectl.py
test-compat: install
	@status=0; \
	for v in $(COMPAT_TRAINERS); do echo "== Trainer $$v (Kubernetes default)"; \
	  DISPATCH_E2E_TRAINER=$$v $(PY) -m tests.e2e.toolchain etcd kube trainer crds jobset && \
	  DISPATCH_E2E_TRAINER=$$v $(PY) -m pytest $(COMPAT_TESTS) $(PYTEST_ARGS) || status=1; done; \
	for v in $(COMPAT_KUBERNETES); do echo "== Kubernetes $$v (Trainer default)"; \
	  DISPATCH_E2E_KUBERNETES=$$v $(PY) -m tests.e2e.toolchain etcd kube trainer crds jobset && \
	  DISPATCH_E2E_KUBERNETES=$$v $(PY) -m pytest $(COMPAT_TESTS) $(PYTEST_ARGS) || status=1; done; \
	exit $$status

unit: install lint wrk
	$(PY) -m pytest $(XDIST) tests/unit tests/server $(PYTEST_ARGS)

e2e: install toolchain
	$(PY) -m pytest $(XDIST) tests/e2e $(addprefix --ignore=,$(EXTRA_TESTS)) $(PYTEST_ARGS)

# Re-pins the image's Python dependencies (requirements/image.lock, with hashes) from pyproject.toml and
# requirements/build.in; the Dockerfile installs exactly these. Needs the package index. Resolved with this
# machine's Python (3.11) for the image's (3.13): the hashes cover every file of each pin, and the e2e build
# (wheels only, `pip check`) fails if a pin has no wheel for 3.13 or needs another dependency there.
lock: install
	$(VENV)/bin/pip install --quiet 'pip-tools>=7.4'
	CUSTOM_COMPILE_COMMAND="make lock" $(VENV)/bin/pip-compile --quiet --upgrade --generate-hashes --allow-unsafe \
	  --strip-extras --no-emit-index-url --no-emit-find-links -o requirements/image.lock pyproject.toml requirements/build.in

# Our webhooks beside Trainer's on one API server (issue 15): admission latency as the API server measures it.
bench-cluster: install toolchain
	$(PY) bench/cluster.py

# Our webhook against the same rules as Kyverno v1.15.2 policies (bench/kyverno) and as in-tree admission
# policies (bench/cel), on one API server (issues 27 and 37). Without Kyverno: bench/cluster.py --kyverno-only --no-kyverno.
KYVERNO_N ?= 200
bench-kyverno: install toolchain toolchain-extra
	$(PY) bench/cluster.py --kyverno-only -n $(KYVERNO_N)

# Every rule of the registry switched off in turn must fail the unit tests marked for it.
sweep: install
	$(PY) -m tests.sweep

bench: install wrk
	$(PY) bench/admission.py

# The wheel and the sdist, in dist/: `uv tool install dist/dispatch_admission-*.whl` (or `pipx install` of it) puts
# the dispatch-admission command on PATH alone, as docs/ci.md says.
dist: install
	rm -rf dist
	$(VENV)/bin/uv build --quiet --out-dir dist

clean:
	rm -rf $(VENV) certs/*.crt certs/*.key .pytest_cache .hypothesis .mypy_cache .ruff_cache
