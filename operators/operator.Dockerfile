# The TrainingRun operator (kopf) and `agentgym operator check` (the Helm test). Build from the repository root:
#   docker build -f operators/operator.Dockerfile -t agentgym/operator .
# Installs only the operator's dependencies (kopf on top of the shared core: pydantic, nats-py, aiohttp).
# Each extra's requirement list (scripts/extra-requirements.py). The dependency layers below copy only theirs: a
# source edit reinstalls the platform alone (seconds), not its dependencies (minutes). The same lines in every image.
FROM python:3.11-slim AS requirements
COPY pyproject.toml scripts/extra-requirements.py /src/
RUN python /src/extra-requirements.py /src/pyproject.toml /requirements

FROM python:3.11-slim AS build
WORKDIR /src
# The platform installs into /opt/agentgym-platform, on the venv's path: a source edit leaves the venv as it is.
RUN python -m venv /opt/venv \
    && echo /opt/agentgym-platform >"$(/opt/venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/agentgym-platform.pth"
ENV PATH=/opt/venv/bin:$PATH PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
COPY --from=requirements /requirements/operator.txt /requirements/
RUN pip install --no-cache-dir -r /requirements/operator.txt
COPY pyproject.toml README.md ./
COPY common common
COPY services services
COPY trainer trainer
COPY operators operators
# The platform itself, on the dependencies above.
RUN pip install --no-cache-dir --no-deps --target /opt/agentgym-platform .

FROM python:3.11-slim
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin agentgym
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/agentgym-platform /opt/agentgym-platform
ENV PATH=/opt/agentgym-platform/bin:/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp
USER 10001
# kopf's liveness endpoint (`--liveness http://0.0.0.0:8080/healthz`).
EXPOSE 8080
ENTRYPOINT ["agentgym", "operator"]
CMD ["run"]
