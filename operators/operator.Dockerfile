# The TrainingRun operator (kopf) and `agentgym operator check` (the Helm test). Build from the repository root:
#   docker build -f operators/operator.Dockerfile -t agentgym/operator .
# Installs only the operator's dependencies (kopf on top of the shared core: pydantic, nats-py, aiohttp).
FROM python:3.11-slim AS build
WORKDIR /src
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PIP_DISABLE_PIP_VERSION_CHECK=1
COPY pyproject.toml README.md ./
COPY common common
COPY services services
COPY trainer trainer
COPY operators operators
RUN pip install --no-cache-dir ".[operator]"

FROM python:3.11-slim
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin agentgym
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp
USER 10001
# kopf's liveness endpoint (`--liveness http://0.0.0.0:8080/healthz`).
EXPOSE 8080
ENTRYPOINT ["agentgym", "operator"]
CMD ["run"]
