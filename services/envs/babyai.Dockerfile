# babyai environment service. Build from the repository root:
#   docker build -f services/envs/babyai.Dockerfile -t agentgym/env-babyai .
FROM python:3.11-slim AS build
WORKDIR /src
RUN python -m venv /opt/venv
COPY pyproject.toml README.md ./
COPY common common
COPY services/envs services/envs
COPY trainer trainer
COPY operators operators
# The shared core and the service framework first: the same layer in every environment image.
RUN /opt/venv/bin/pip install --no-cache-dir ".[env-server]"
RUN /opt/venv/bin/pip install --no-cache-dir ".[babyai]"

FROM python:3.11-slim
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin agentgym
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
USER 10001
EXPOSE 8000 50051
HEALTHCHECK --interval=10s --timeout=3s CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz')"]
ENTRYPOINT ["agentgym", "env", "serve", "babyai", "--host", "0.0.0.0", "--port", "8000", "--grpc-port", "50051"]
