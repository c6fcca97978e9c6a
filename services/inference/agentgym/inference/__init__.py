"""Policy serving: an OpenAI-compatible HF-transformers engine (CPU/GPU) and the vLLM adapter."""
