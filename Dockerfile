# syntax=docker/dockerfile:1
# dispatch-admission: the webhook served by gunicorn through `dispatch-admission serve`.
# Build: docker build -t REGISTRY/dispatch-admission:0.1.0 .
# The base is pinned by digest; refresh it with `docker buildx imagetools inspect python:3.11-slim-bookworm`.
ARG PYTHON_BASE=python:3.11-slim-bookworm@sha256:2e32f7d302adc1c37428355c1e646897c0c53f4fd60b6a551245fb90ee129f91

FROM ${PYTHON_BASE} AS build
WORKDIR /src
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
COPY pyproject.toml README.md ./
COPY webhook ./webhook
# The package and every dependency as wheels; the final stage installs only these.
RUN pip wheel --wheel-dir /wheels .

FROM ${PYTHON_BASE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
COPY --from=build /wheels /tmp/wheels
# Install from the wheels alone (no index, no compiler), then drop the installers: no build tools remain.
RUN pip install --no-index --find-links /tmp/wheels dispatch-admission \
 && rm -rf /tmp/wheels \
 && pip uninstall -y pip setuptools wheel
# A numeric non-root user, matching the chart's runAsUser.
USER 65532:65532
EXPOSE 8443
ENTRYPOINT ["dispatch-admission"]
CMD ["serve", "--settings=/etc/dispatch-admission/settings/settings.json", "--cert-dir=/etc/dispatch-admission/tls"]
