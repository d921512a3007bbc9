# dispatch-admission: the webhook served by gunicorn through `dispatch-admission serve`.
#
#   docker build -t REGISTRY/dispatch-admission:0.1.0 .
#
# With its SBOM and its provenance attached (BuildKit's attestations, both stored beside the image):
#   docker buildx build --sbom=true --provenance=mode=max -t REGISTRY/dispatch-admission:0.1.0 --push .
#
# Behind a TLS-intercepting proxy, or with a private package index, pass them as build secrets (both
# optional; neither reaches the image, nor its history):
#   docker build --secret id=pipcert,src=/etc/ssl/certs/ca-certificates.crt \
#                --secret id=pipconf,src=$HOME/.config/pip/pip.conf -t ... .
# An index without credentials can also be given as --build-arg PIP_INDEX_URL=... (build stage only; build
# arguments are recorded in the provenance, so credentials belong in the pipconf secret).
#
# The Python dependencies are requirements/image.lock, pinned with hashes (`make lock` renews it).
# Debian 13 (trixie), Python 3.13, in two bases pinned by digest (refresh them with
# `docker buildx imagetools inspect IMAGE:TAG`):
# - BUILD_BASE, where the venv is made: Debian's python3 and its venv module (python3-venv is installed
#   when the base lacks it, as debian:trixie-slim does).
# - RUNTIME_BASE, the final image's: distroless, Debian's Python and its libraries with no shell, no
#   coreutils and no package manager. Any such base with Debian 13's interpreter at the same path as the build
#   base's (PYTHON) will do.
ARG BUILD_BASE=debian:trixie-slim@sha256:a29215f6a35e51e22adffa17f89e9d2ef06214e64a2bad10d765c46aea49f11f
ARG RUNTIME_BASE=gcr.io/distroless/python3-debian13@sha256:e866e2f9fbaa19f63e579cf2f61b7f76cd8a74c43a62a0af95d48678d9878436
# The interpreter both bases share: the venv's `python` links to it.
ARG PYTHON=/usr/bin/python3.13

# The build stage runs on the builder's own platform, whatever the target: for another one (linux/arm64 on an
# amd64 builder, or the reverse) it fetches the target's wheels and installs them without running any of them,
# so a multi-platform build needs no emulation:
#   docker buildx build --platform linux/amd64,linux/arm64 -t REGISTRY/dispatch-admission:0.1.0 --push .
FROM --platform=$BUILDPLATFORM ${BUILD_BASE} AS build
ARG PYTHON
ARG TARGETARCH
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_TRUSTED_HOST
# Where pip finds the optional secrets; unset below when they were not given.
ARG PIP_CERT=/run/secrets/pipcert
ARG PIP_CONFIG_FILE=/run/secrets/pipconf
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1
# Two environments made by the interpreter the final stage has at the same path (not /usr/bin/python3: a
# distroless base has only python3.13): /opt/venv, the unit copied to the final stage, with no pip in it, and
# /tmp/tools, where pip and the build-only packages run. A venv is links to $PYTHON and a pyvenv.cfg: the same
# on every platform of one Debian release.
RUN set -eu; \
    if ! "$PYTHON" -c 'import ensurepip, venv' 2>/dev/null; then \
      apt-get update -qq; \
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv; \
      rm -rf /var/lib/apt/lists/*; \
    fi; \
    "$PYTHON" -m venv --without-pip /opt/venv; \
    "$PYTHON" -m venv /tmp/tools
COPY requirements/image.lock /tmp/image.lock
# The target's wheels for every pin of the lock: exact versions, wheels only, hashes checked, for Debian 13's
# CPython and C library on the target's CPU (glibc's version from the build base: the same release). pip's
# target tags are kept in /tmp/target-tags for the resolution check below.
RUN --mount=type=secret,id=pipcert,required=false \
    --mount=type=secret,id=pipconf,required=false \
    set -eu; \
    [ -s "$PIP_CERT" ] || unset PIP_CERT; \
    [ -s "$PIP_CONFIG_FILE" ] || unset PIP_CONFIG_FILE; \
    case "$TARGETARCH" in \
      amd64) machine=x86_64 ;; \
      arm64) machine=aarch64 ;; \
      *) echo "TARGETARCH=$TARGETARCH: the image is built for linux/amd64 and linux/arm64" >&2; exit 1 ;; \
    esac; \
    py=$("$PYTHON" -c 'import sys; print("%d%d" % sys.version_info[:2])'); \
    glibc=$("$PYTHON" -c 'import os; print(os.confstr("CS_GNU_LIBC_VERSION").split(".")[1])'); \
    tags="--python-version $py --implementation cp --abi cp$py --abi abi3 --abi none"; \
    for minor in $(seq "$glibc" -1 17); do tags="$tags --platform manylinux_2_${minor}_$machine"; done; \
    tags="$tags --platform manylinux2014_$machine --platform linux_$machine"; \
    echo "$tags" > /tmp/target-tags; \
    /tmp/tools/bin/pip download --require-hashes --only-binary=:all: $tags -r /tmp/image.lock -d /tmp/wheels
WORKDIR /src
COPY pyproject.toml README.md ./
COPY webhook ./webhook
# The locked build backend and PyPA's installer (pure Python) into /tmp/tools; the package built as a wheel
# (no index, no new dependency); a consistency check: the package resolved for the target from these wheels
# alone; then every wheel but the build-only ones installed into /opt/venv by `installer`, as pip would
# install them, but without pip's check that a wheel fits the machine that runs the build.
# Bytecode is compiled once, in one process, hash-based: the same bytes on every build, and on every platform.
RUN set -eu; \
    /tmp/tools/bin/pip install --quiet --no-index --no-deps \
      /tmp/wheels/setuptools-*.whl /tmp/wheels/wheel-*.whl /tmp/wheels/installer-*.whl; \
    /tmp/tools/bin/pip wheel --quiet --no-index --no-deps --no-build-isolation --wheel-dir /tmp/wheels . ; \
    /tmp/tools/bin/pip install --quiet --dry-run --ignore-installed --no-index --find-links /tmp/wheels \
      --only-binary=:all: $(cat /tmp/target-tags) dispatch-admission; \
    set --; \
    for wheel in /tmp/wheels/*.whl; do \
      case "${wheel##*/}" in setuptools-*|wheel-*|installer-*) ;; *) set -- "$@" "$wheel" ;; esac; \
    done; \
    PYTHONPATH=$(/tmp/tools/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))') \
      /opt/venv/bin/python -m installer --no-compile-bytecode --validate-record=all "$@"; \
    /opt/venv/bin/python -m compileall -q --invalidation-mode unchecked-hash /opt/venv/lib

# The final stage runs nothing (the base has no shell to run it with): the venv is copied in, nothing else.
FROM ${RUNTIME_BASE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH
COPY --from=build /opt/venv /opt/venv
LABEL org.opencontainers.image.title="dispatch-admission" \
      org.opencontainers.image.description="Admission webhook for Kubeflow Trainer TrainJobs: the dispatch publish mount" \
      org.opencontainers.image.licenses="Apache-2.0"
# A numeric non-root user, matching the chart's runAsUser.
USER 65532:65532
EXPOSE 8443
ENTRYPOINT ["dispatch-admission"]
CMD ["serve", "--settings=/etc/dispatch-admission/settings/settings.json", "--cert-dir=/etc/dispatch-admission/tls"]
