# Rollout workers: the agent loop (RolloutRequests from NATS, episodes against environment services and
# inference, Trajectories back to NATS). Build from the repository root:
#   docker build -f services/rollout/rollout.Dockerfile -t agentgym/rollout .
# Installs only the rollout dependencies (the tokenizer side of transformers; no torch).
FROM python:3.11-slim AS build
WORKDIR /src
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PIP_DISABLE_PIP_VERSION_CHECK=1
COPY pyproject.toml README.md ./
COPY common common
COPY services services
COPY trainer trainer
COPY operators operators
RUN pip install --no-cache-dir ".[rollout]"

FROM python:3.11-slim
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin agentgym
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp HF_HOME=/tmp/hf
USER 10001
# The operator passes: --run <name> --nats-url ... --inference-url ... --env-url <kind>=<url> ...
ENTRYPOINT ["agentgym", "rollout", "worker"]
