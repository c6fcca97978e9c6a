"""OpenTelemetry for every process of the platform: traces and metrics.

`setup_telemetry("rollout")` exports over OTLP/HTTP when `OTEL_EXPORTER_OTLP_ENDPOINT` is set (the
cluster's collector) and otherwise appends JSON lines to `<dir>/traces.jsonl` and
`<dir>/metrics.jsonl`, which `read_spans` (and `agentgym traces`) read back; with only
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` set (a local trace UI, `agentgym run --ui`), spans go to the files and
to that endpoint. Trace context crosses NATS in message headers via `inject_context` / `extract_context`.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

OTLP_ENDPOINT_VAR = "OTEL_EXPORTER_OTLP_ENDPOINT"
OTLP_TRACES_ENDPOINT_VAR = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
TELEMETRY_DIR_VAR = "AGENTGYM_TELEMETRY_DIR"


class JsonlSpanExporter(SpanExporter):
    """Appends one JSON object per finished span to a file (thread-safe, line-buffered)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._file = path.open("a", encoding="utf-8")

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = [json.dumps(span_to_dict(span), default=str) for span in spans]
        with self._lock:
            if self._file.closed:
                return SpanExportResult.FAILURE
            self._file.write("".join(line + "\n" for line in lines))
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True


class JsonlMetricExporter(MetricExporter):
    """Appends one JSON object per metric data point per export to a file."""

    def __init__(self, path: Path) -> None:
        super().__init__(preferred_temporality={}, preferred_aggregation={})
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._file = path.open("a", encoding="utf-8")

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        lines = []
        for resource_metrics in metrics_data.resource_metrics:
            service = resource_metrics.resource.attributes.get("service.name", "")
            for scope in resource_metrics.scope_metrics:
                for metric in scope.metrics:
                    for point in metric.data.data_points:
                        record: dict[str, Any] = {
                            "service": service,
                            "name": metric.name,
                            "unit": metric.unit,
                            "time_unix_nano": point.time_unix_nano,
                            "attributes": dict(point.attributes or {}),
                        }
                        if hasattr(point, "value"):
                            record["value"] = point.value
                        else:  # histogram
                            record.update(count=point.count, sum=point.sum, min=point.min, max=point.max)
                        lines.append(json.dumps(record, default=str))
        with self._lock:
            if not self._file.closed and lines:
                self._file.write("".join(line + "\n" for line in lines))
                self._file.flush()
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        with self._lock:
            self._file.close()


def span_to_dict(span: ReadableSpan) -> dict[str, Any]:
    context = span.get_span_context()
    parent = span.parent
    start = span.start_time or 0
    end = span.end_time or start
    return {
        "name": span.name,
        "trace_id": f"{context.trace_id:032x}" if context else "",
        "span_id": f"{context.span_id:016x}" if context else "",
        "parent_span_id": f"{parent.span_id:016x}" if parent else None,
        "service": span.resource.attributes.get("service.name", ""),
        "kind": span.kind.name,
        "start_unix_nano": start,
        "end_unix_nano": end,
        "duration_s": (end - start) / 1e9,
        "status": span.status.status_code.name,
        "status_description": span.status.description,
        "attributes": dict(span.attributes or {}),
        "events": [{"name": e.name, "attributes": dict(e.attributes or {})} for e in span.events],
    }


@dataclass
class Telemetry:
    tracer_provider: TracerProvider
    meter_provider: MeterProvider
    destination: str  # "otlp:<endpoint>" or the JSONL directory

    def tracer(self, name: str) -> trace.Tracer:
        return self.tracer_provider.get_tracer(name)

    def shutdown(self) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


def setup_telemetry(
    service_name: str,
    *,
    directory: str | Path | None = None,
    endpoint: str | None = None,
    sample_ratio: float = 1.0,
    metric_interval_s: float = 10.0,
    set_global: bool = True,
    resource_attributes: Mapping[str, str] | None = None,
) -> Telemetry:
    """Tracer and meter providers for one process; OTLP when an endpoint is known, else JSONL files.

    The endpoint comes from the argument or `OTEL_EXPORTER_OTLP_ENDPOINT`; the JSONL directory from
    the argument, `AGENTGYM_TELEMETRY_DIR`, or `./telemetry`.
    """
    resource = Resource.create({"service.name": service_name, **(resource_attributes or {})})
    sampler = ParentBased(TraceIdRatioBased(sample_ratio))
    tracer_provider = TracerProvider(resource=resource, sampler=sampler)
    endpoint = endpoint or os.environ.get(OTLP_ENDPOINT_VAR)
    span_exporter: SpanExporter
    metric_exporter: MetricExporter
    if endpoint:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        base = endpoint.rstrip("/")
        span_exporter = OTLPSpanExporter(endpoint=f"{base}/v1/traces")
        metric_exporter = OTLPMetricExporter(
            endpoint=f"{base}/v1/metrics",
            preferred_temporality={},
        )
        destination = f"otlp:{base}"
    else:
        out = Path(directory or os.environ.get(TELEMETRY_DIR_VAR) or "telemetry")
        span_exporter = JsonlSpanExporter(out / "traces.jsonl")
        metric_exporter = JsonlMetricExporter(out / "metrics.jsonl")
        destination = str(out)
    tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter, schedule_delay_millis=1000))
    traces_endpoint = os.environ.get(OTLP_TRACES_ENDPOINT_VAR)
    if traces_endpoint and not endpoint:
        # A trace UI beside the files (`agentgym run --ui`): the JSONL stays the run's record, the UI gets a copy.
        # The exporter reads its headers (e.g. the MLflow experiment) from OTEL_EXPORTER_OTLP_TRACES_HEADERS.
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        ui_exporter = OTLPSpanExporter(endpoint=traces_endpoint)
        tracer_provider.add_span_processor(BatchSpanProcessor(ui_exporter, schedule_delay_millis=1000))
        destination += f" + otlp:{traces_endpoint}"
    reader = PeriodicExportingMetricReader(metric_exporter, export_interval_millis=int(metric_interval_s * 1000))
    meter_provider = MeterProvider(resource=resource, metric_readers=[reader])
    if set_global:
        trace.set_tracer_provider(tracer_provider)
        from opentelemetry import metrics

        metrics.set_meter_provider(meter_provider)
    return Telemetry(tracer_provider, meter_provider, destination)


def inject_context(headers: dict[str, str] | None = None, context: Context | None = None) -> dict[str, str]:
    """W3C trace-context headers for the current (or given) span, to put on a NATS message."""
    carrier: dict[str, str] = dict(headers or {})
    propagate.inject(carrier, context=context)
    return carrier


def extract_context(headers: Mapping[str, str] | None) -> Context:
    """The remote parent context carried in message headers (empty context when absent)."""
    return propagate.extract(dict(headers or {}))


def read_spans(path: str | Path) -> Iterator[dict[str, Any]]:
    """Spans from a traces.jsonl file (or a directory holding one); skips torn last lines."""
    path = Path(path)
    if path.is_dir():
        path = path / "traces.jsonl"
    if not path.exists():
        return
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


__all__ = [
    "AggregationTemporality",
    "JsonlMetricExporter",
    "JsonlSpanExporter",
    "Telemetry",
    "extract_context",
    "inject_context",
    "read_spans",
    "setup_telemetry",
]
