"""Telemetry: spans and metrics land in JSONL without a collector; context crosses message headers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from opentelemetry import trace

from agentgym.telemetry import extract_context, inject_context, read_spans, setup_telemetry


def test_spans_and_metrics_go_to_jsonl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    telemetry = setup_telemetry("test-service", directory=tmp_path, set_global=False)
    assert telemetry.destination == str(tmp_path)
    tracer = telemetry.tracer("tests")
    with (
        tracer.start_as_current_span("invoke_agent", attributes={"agentgym.env": "babyai"}) as parent,
        tracer.start_as_current_span("chat") as child,
    ):
        child.set_attribute("gen_ai.usage.output_tokens", 12)
    counter = telemetry.meter_provider.get_meter("tests").create_counter("agentgym.steps")
    counter.add(3, {"environment": "babyai"})
    telemetry.shutdown()

    spans = list(read_spans(tmp_path))
    by_name = {s["name"]: s for s in spans}
    assert set(by_name) == {"invoke_agent", "chat"}
    assert by_name["chat"]["parent_span_id"] == by_name["invoke_agent"]["span_id"]
    assert by_name["chat"]["trace_id"] == f"{parent.get_span_context().trace_id:032x}"
    assert by_name["invoke_agent"]["attributes"] == {"agentgym.env": "babyai"}
    assert by_name["chat"]["service"] == "test-service"
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if m["name"] == "agentgym.steps"]
    assert steps and steps[-1]["value"] == 3 and steps[-1]["attributes"] == {"environment": "babyai"}


def test_trace_context_round_trips_through_headers(tmp_path: Path) -> None:
    telemetry = setup_telemetry("producer", directory=tmp_path, set_global=False)
    tracer = telemetry.tracer("tests")
    with tracer.start_as_current_span("publish") as span:
        headers = inject_context({"Nats-Msg-Id": "abc"})
    assert headers["Nats-Msg-Id"] == "abc" and "traceparent" in headers
    remote = trace.get_current_span(extract_context(headers)).get_span_context()
    assert remote.trace_id == span.get_span_context().trace_id
    assert not trace.get_current_span(extract_context({})).get_span_context().is_valid
    telemetry.shutdown()


def test_otlp_endpoint_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9/")
    telemetry = setup_telemetry("svc", directory=tmp_path, set_global=False, metric_interval_s=3600)
    assert telemetry.destination == "otlp:http://127.0.0.1:9"
    assert not (tmp_path / "traces.jsonl").exists()
    telemetry.tracer_provider.shutdown()
