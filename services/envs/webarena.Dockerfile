# webarena environment service (Playwright driving Debian's Chromium; MiniWoB++ tasks built in).
# Build from the repository root:
#   docker build -f services/envs/webarena.Dockerfile -t agentgym/env-webarena .
# One Chromium per container, one isolated browser context per live episode (~40 MB PSS each):
#   docker run -p 8000:8000 --shm-size=256m agentgym/env-webarena
# Real WebArena: mount the task configs and point at the sites, e.g.
#   docker run -v $PWD/config_files:/tasks -e WA_SHOPPING=http://shop:7770 ... agentgym/env-webarena \
#     --set tasks_path=/tasks/test.raw.json
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
COPY --from=requirements /requirements/webarena.txt /requirements/
RUN /opt/venv/bin/pip install --no-cache-dir -r /requirements/webarena.txt
COPY pyproject.toml README.md ./
COPY common common
COPY services/envs services/envs
COPY trainer trainer
COPY operators operators
# The platform itself, on the dependencies above.
RUN /opt/venv/bin/pip install --no-cache-dir --no-deps --target /opt/agentgym-platform .

FROM python:3.11-slim
# Debian's Chromium and its fonts; Playwright's own browser download is not used. libatomic1: Playwright's bundled
# node driver links it (without it every episode fails: "Connection closed while reading from the driver").
RUN apt-get update \
    && apt-get install -y --no-install-recommends chromium fonts-liberation libatomic1 \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin agentgym
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/agentgym-platform /opt/agentgym-platform
ENV PATH=/opt/agentgym-platform/bin:/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 \
    AGENTGYM_CHROMIUM=/usr/bin/chromium WA_LOGIN_CACHE=/tmp/webarena-auth
USER 10001
EXPOSE 8000 50051
HEALTHCHECK --interval=10s --timeout=3s CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz')"]
ENTRYPOINT ["agentgym", "env", "serve", "webarena", "--host", "0.0.0.0", "--port", "8000", "--grpc-port", "50051"]
