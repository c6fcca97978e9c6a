"""Prometheus metrics of one inference server (its own registry, so several servers can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class InferenceMetrics:
    """Requests, batch sizes, tokens, queue wait, generation time, weight loads, policy version."""

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
        self.prompt_tokens = Counter("agentgym_inference_prompt_tokens", "Prompt tokens prefilled", registry=r)
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
        self.weight_loads = Counter(
            "agentgym_inference_weight_loads", "Weight load requests by outcome", ["result"], registry=r
        )
        self.weight_load_time = Histogram(
            "agentgym_inference_weight_load_seconds",
            "Time to load new weights and swap them in",
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
