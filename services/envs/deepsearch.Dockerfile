# deepsearch environment service. Build from the repository root:
#   docker build -f services/envs/deepsearch.Dockerfile -t agentgym/env-deepsearch .
# The BM25 index of the shipped corpus is built into the image (read-only at run time). Set
# SEARCH_URL=http://host:port to search an external Search-R1 retriever (the full wiki-18 e5 index)
# instead. The same image runs the retrieval service alone:
#   docker run -p 8001:8001 agentgym/env-deepsearch python -m agentgym.envs.deepsearch.retriever --host 0.0.0.0
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
# The shared core and the service framework first: the same layers in every environment image.
COPY --from=requirements /requirements/env-server.txt /requirements/
RUN /opt/venv/bin/pip install --no-cache-dir -r /requirements/env-server.txt
COPY --from=requirements /requirements/deepsearch.txt /requirements/
RUN /opt/venv/bin/pip install --no-cache-dir -r /requirements/deepsearch.txt
COPY pyproject.toml README.md ./
COPY common common
COPY services/envs services/envs
COPY trainer trainer
COPY operators operators
# The platform itself, on the dependencies above.
RUN /opt/venv/bin/pip install --no-cache-dir --no-deps --target /opt/agentgym-platform .

FROM python:3.11-slim
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin agentgym
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/agentgym-platform /opt/agentgym-platform
ENV PATH=/opt/agentgym-platform/bin:/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 AGENTGYM_CACHE_DIR=/opt/agentgym/cache
RUN python -m agentgym.envs.deepsearch.retriever --build-only && chmod -R a+rX /opt/agentgym
USER 10001
EXPOSE 8000 50051 8001
HEALTHCHECK --interval=10s --timeout=3s CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz')"]
CMD ["agentgym", "env", "serve", "deepsearch", "--host", "0.0.0.0", "--port", "8000", "--grpc-port", "50051"]
