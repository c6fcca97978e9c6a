"""`agentgym traces <run-dir>`: where the time went and what failed, from the run's trace spans."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from agentgym.telemetry import read_spans


def summarise_traces(run_dir: Path, slowest: int = 10) -> dict[str, Any]:
    """Slowest episodes, error counts by reason, and the split of episode time between inference and env."""
    path = run_dir / "telemetry" / "traces.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist (traces go there unless OTEL_EXPORTER_OTLP_ENDPOINT is set)")
    episodes, chat_seconds, env_seconds = [], 0.0, 0.0
    errors: Counter[str] = Counter()
    for span in read_spans(path):
        operation = span.get("attributes", {}).get("gen_ai.operation.name")
        if operation == "invoke_agent":
            episodes.append(span)
            termination = span["attributes"].get("agentgym.termination", "")
            if termination == "TERMINATION_ERROR" or span.get("status") == "ERROR":
                reason = span.get("status_description") or termination or "unknown"
                errors[_reason_class(reason)] += 1
        elif operation == "chat":
            chat_seconds += span["duration_s"]
        elif operation == "execute_tool":
            env_seconds += span["duration_s"]
    total = sum(e["duration_s"] for e in episodes)
    top = sorted(episodes, key=lambda e: e["duration_s"], reverse=True)[:slowest]
    return {
        "episodes": len(episodes),
        "episode_seconds": total,
        "inference_seconds": chat_seconds,
        "env_seconds": env_seconds,
        "other_seconds": max(total - chat_seconds - env_seconds, 0.0),
        "errors": dict(errors.most_common()),
        "slowest": [
            {
                "seconds": round(e["duration_s"], 3),
                "environment": e["attributes"].get("agentgym.env"),
                "task_id": e["attributes"].get("agentgym.task_id"),
                "turns": e["attributes"].get("agentgym.turns"),
                "termination": e["attributes"].get("agentgym.termination"),
                "trace_id": e["trace_id"],
            }
            for e in top
        ],
    }


def _reason_class(reason: str) -> str:
    """Group error messages by their kind (the text before the first colon), capped in length."""
    head = reason.split(":", 1)[0].strip()
    return head[:80] or "unknown"
