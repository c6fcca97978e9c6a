# sciworld environment service (ScienceWorld on a headless Java 17 runtime). Build from the repository root:
#   docker build -f services/envs/sciworld.Dockerfile -t agentgym/env-sciworld .
# A pool slot is one simulator; 8 slots share a JVM by default (heap capped at 768 MB per simulator,
# ~20-40 MB resident per slot in practice). Size the pool to the live episodes expected, e.g.:
#   docker run -p 8000:8000 agentgym/env-sciworld --set pool_size=16 --set heap_mb=768
# ScienceWorld's classes are archived (AppCDS) at build time so the JVMs start faster and share pages.
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
COPY --from=requirements /requirements/sciworld.txt /requirements/
RUN /opt/venv/bin/pip install --no-cache-dir -r /requirements/sciworld.txt
COPY pyproject.toml README.md ./
COPY common common
COPY services/envs services/envs
COPY trainer trainer
COPY operators operators
# The platform itself, on the dependencies above.
RUN /opt/venv/bin/pip install --no-cache-dir --no-deps --target /opt/agentgym-platform .

FROM python:3.11-slim
# (the man1 directory: the JRE's post-install scripts expect it on slim images)
RUN mkdir -p /usr/share/man/man1 \
    && apt-get update \
    && apt-get install -y --no-install-recommends openjdk-17-jre-headless \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin agentgym
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/agentgym-platform /opt/agentgym-platform
ENV PATH=/opt/agentgym-platform/bin:/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    AGENTGYM_SCIWORLD_CDS_DIR=/opt/agentgym/sciworld-cds
RUN python -m agentgym.envs.sciworld.jvm && chmod -R a+rX /opt/agentgym
USER 10001
EXPOSE 8000 50051
HEALTHCHECK --interval=10s --timeout=3s CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz')"]
ENTRYPOINT ["agentgym", "env", "serve", "sciworld", "--host", "0.0.0.0", "--port", "8000", "--grpc-port", "50051"]
