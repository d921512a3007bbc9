# dispatch-admission: the webhook served by gunicorn through `dispatch-admission serve`.
#
#   docker build -t REGISTRY/dispatch-admission:0.1.0 .
#
# Behind a TLS-intercepting proxy, or with a private package index, pass them as build secrets (both
# optional; neither reaches the image, nor its history):
#   docker build --secret id=pipcert,src=/etc/ssl/certs/ca-certificates.crt \
#                --secret id=pipconf,src=$HOME/.config/pip/pip.conf -t ... .
# An index without credentials can also be given as --build-arg PIP_INDEX_URL=... (build stage only).
#
# The Python dependencies are requirements/image.lock, pinned with hashes (`make lock` renews it).
# The base is pinned by digest; refresh it with `docker buildx imagetools inspect python:3.11-slim-bookworm`.
# Any base with Python 3.11 as `python3` on PATH and its venv module will do (--build-arg PYTHON_BASE=...).
ARG PYTHON_BASE=python:3.11-slim-bookworm@sha256:2e32f7d302adc1c37428355c1e646897c0c53f4fd60b6a551245fb90ee129f91

FROM ${PYTHON_BASE} AS build
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_TRUSTED_HOST
# Where pip finds the optional secrets; unset below when they were not given.
ARG PIP_CERT=/run/secrets/pipcert
ARG PIP_CONFIG_FILE=/run/secrets/pipconf
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONDONTWRITEBYTECODE=1
# A virtual environment is the unit copied to the final stage: the same path whichever base this is
# (python3 is /usr/local/bin/python3 in the official image, /usr/bin/python3 in Debian's).
RUN python3 -m venv /opt/venv
COPY requirements/image.lock /tmp/image.lock
# Every dependency (and the build backend) from the lock: exact versions, wheels only, hashes checked.
RUN --mount=type=secret,id=pipcert,required=false \
    --mount=type=secret,id=pipconf,required=false \
    set -eu; \
    [ -s "$PIP_CERT" ] || unset PIP_CERT; \
    [ -s "$PIP_CONFIG_FILE" ] || unset PIP_CONFIG_FILE; \
    /opt/venv/bin/pip install --no-compile --require-hashes --only-binary=:all: -r /tmp/image.lock
WORKDIR /src
COPY pyproject.toml README.md ./
COPY webhook ./webhook
# The package itself (no index, no new dependency), a consistency check, then the installers go.
# Bytecode is compiled once, in one process, hash-based: the same bytes on every build.
RUN set -eu; \
    /opt/venv/bin/pip install --no-compile --no-index --no-deps --no-build-isolation . ; \
    /opt/venv/bin/pip check; \
    /opt/venv/bin/pip uninstall -y -q pip setuptools wheel; \
    /opt/venv/bin/python -m compileall -q --invalidation-mode unchecked-hash /opt/venv/lib

FROM ${PYTHON_BASE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH
# No installer or package manager stays usable: the base Python's pip, setuptools and wheel, ensurepip
# and the wheels it would install, and apt's and dpkg's commands and state. dpkg's status database is
# kept, so that image scanners still see the Debian packages.
RUN set -eu; \
    if python3 -m pip --version >/dev/null 2>&1; then python3 -m pip uninstall -y -q pip setuptools wheel; fi; \
    ensurepip="$(python3 -c 'import ensurepip, os; print(os.path.dirname(ensurepip.__file__))' 2>/dev/null || true)"; \
    rm -rf ${ensurepip:+"$ensurepip"} /usr/share/python-wheels \
      /usr/bin/apt /usr/bin/apt-* /usr/lib/apt /etc/apt /var/lib/apt /var/cache/apt \
      /usr/bin/dpkg /usr/bin/dpkg-* /usr/sbin/dpkg-* /usr/lib/dpkg /usr/libexec/dpkg \
      /etc/cron.daily/apt-compat /etc/cron.daily/dpkg /usr/share/bug/apt /usr/share/bug/dpkg
COPY --from=build /opt/venv /opt/venv
LABEL org.opencontainers.image.title="dispatch-admission" \
      org.opencontainers.image.description="Admission webhook for Kubeflow Trainer TrainJobs: the dispatch publish mount" \
      org.opencontainers.image.licenses="Apache-2.0"
# A numeric non-root user, matching the chart's runAsUser.
USER 65532:65532
EXPOSE 8443
ENTRYPOINT ["dispatch-admission"]
CMD ["serve", "--settings=/etc/dispatch-admission/settings/settings.json", "--cert-dir=/etc/dispatch-admission/tls"]
