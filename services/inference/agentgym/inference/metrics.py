"""Prometheus metrics of one inference server (its own registry, so several servers can live in one process)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class InferenceMetrics:
    """Requests, batch sizes, tokens, queue wait, generation time, prefix cache, weight loads, policy version."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("agentgym_inference_requests", "Completion requests by outcome", ["status"], registry=r)
        self.forward_batches = Counter(
            "agentgym_inference_forward_batches",
            "Model forward passes by phase (prefill admits new sequences; decode advances all running ones)",
            ["phase"],
            registry=r,
        )
        self.batch_size = Histogram(
            "agentgym_inference_batch_size",
            "Sequences in one forward pass",
            ["phase"],
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "agentgym_inference_prompt_tokens",
            "Prompt tokens of admitted requests (prefix-cache hits included)",
            registry=r,
        )
        self.generated_tokens = Counter("agentgym_inference_generated_tokens", "Tokens sampled", registry=r)
        self.queue_wait = Histogram(
            "agentgym_inference_queue_wait_seconds",
            "Time a request waited before its sequences joined a batch",
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.generation_time = Histogram(
            "agentgym_inference_generation_seconds",
            "Time from joining a batch to the request's last sequence finishing",
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.running = Gauge("agentgym_inference_running_sequences", "Sequences in the running batch", registry=r)
        self.waiting = Gauge("agentgym_inference_waiting_sequences", "Sequences queued", registry=r)
        self.policy_version = Gauge("agentgym_inference_policy_version", "Policy version being served", registry=r)
        self.torch_threads = Gauge("agentgym_inference_torch_threads", "Torch intra-op CPU threads", registry=r)
        self.weight_loads = Counter(
            "agentgym_inference_weight_loads", "Weight load requests by outcome", ["result"], registry=r
        )
        self.weight_load_time = Histogram(
            "agentgym_inference_weight_load_seconds",
            "Time to load new weights and swap them in",
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.prefill_tokens = Counter(
            "agentgym_inference_prefill_tokens",
            "Tokens computed by prefill forward passes (prompt tokens not served by the prefix cache; no padding)",
            registry=r,
        )
        self.prefix_cache_lookups = Counter(
            "agentgym_inference_prefix_cache_lookups", "Prompts looked up in the prefix cache", registry=r
        )
        self.prefix_cache_hits = Counter(
            "agentgym_inference_prefix_cache_hits", "Prompts that reused a cached prefix's KV", registry=r
        )
        self.prefix_cache_hit_tokens = Counter(
            "agentgym_inference_prefix_cache_hit_tokens",
            "Prompt tokens whose KV came from the prefix cache (not prefilled)",
            registry=r,
        )
        self.prefix_cache_hit_ratio = Gauge(
            "agentgym_inference_prefix_cache_hit_ratio",
            "Prefix-cache hit tokens / prompt tokens since the server started",
            registry=r,
        )
        self.prefix_cache_tokens = Gauge(
            "agentgym_inference_prefix_cache_tokens",
            "Columns of KV the prefix cache holds (its entries' tokens and the room kept after them)",
            registry=r,
        )
        self.prefix_cache_capacity = Gauge(
            "agentgym_inference_prefix_cache_capacity_tokens",
            "The prefix cache's budget in tokens (0: disabled)",
            registry=r,
        )
        self.prefix_cache_entries = Gauge(
            "agentgym_inference_prefix_cache_entries", "Sequences whose KV the prefix cache holds", registry=r
        )
        self.prefix_cache_evictions = Counter(
            "agentgym_inference_prefix_cache_evictions",
            "Prefix-cache entries dropped, by reason: capacity (least recently used, over the token budget), "
            "superseded (a longer entry starting with the same ids replaced it), weights (a weight update)",
            ["reason"],
            registry=r,
        )
        for reason in ("capacity", "superseded", "weights"):
            self.prefix_cache_evictions.labels(reason)


@dataclass
class EngineStats:
    """Counters read by tests and the benchmark (the Prometheus metrics carry the same figures)."""

    requests: int = 0
    sequences: int = 0
    prefill_batches: int = 0
    decode_steps: int = 0
    prefill_rows: int = 0
    decode_rows: int = 0
    generated_tokens: int = 0
    max_running: int = 0
    swaps: int = 0
    prompt_tokens: int = 0
    """Prompt tokens of admitted requests (one per request, whatever its `n`)."""
    prefill_tokens: int = 0
    """Tokens run through prefill forward passes (padding excluded)."""
    prefix_lookups: int = 0
    prefix_hits: int = 0
    prefix_hit_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache (one count per request, like `prompt_tokens`)."""
    shared_prefills: int = 0
    """Prefixes shared by requests admitted together, prefilled once for all of them."""
