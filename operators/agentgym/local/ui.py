"""A run's traces and metrics in MLflow's UI, on loopback: live during `agentgym run --ui`, or imported afterwards.

Why MLflow: Apache-2.0, one `pip install` (no daemon, no container), a trace view that shows the span tree with
every attribute (the GenAI conventions' `chat`/`execute_tool`/`invoke_agent` spans read as an agent's turns), OTLP/HTTP
ingestion at `/v1/traces`, and run pages that chart metrics per step next to the traces. Phoenix shows agent
traces as well but is under the Elastic License 2.0; Jaeger shows traces but no metrics and is not on PyPI.

MLflow runs in its own virtual environment (`scripts/setup-ui.sh`, `.venv-ui`): its dependencies (Flask, pandas,
scikit-learn, SQLAlchemy, ...) stay out of the platform's. This module talks to it over HTTP only:

- `MlflowServer` starts `mlflow server` on 127.0.0.1 with a SQLite store inside the run directory
  (`<run>/mlflow/`), so the UI of a run is part of the run and reopens without importing again.
- `MlflowClient` is the few REST calls used: an experiment per run, one MLflow run holding the trainer's
  per-step metrics and the spec as parameters, and `/v1/traces` with the experiment (and run) in headers.
- `import_run` loads a finished run directory (`telemetry/traces.jsonl`, `metrics.jsonl`, `status.json`).
- `MetricsFollower` logs `metrics.jsonl` rows as the trainer appends them (live mode); the spans go straight
  from every process to `/v1/traces` (`agentgym.telemetry` adds that exporter beside the JSONL files).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from agentgym.telemetry import read_spans

MLFLOW_VERSION = "3.17.2"
MLFLOW_ENV = "AGENTGYM_MLFLOW"
"""Path of the `mlflow` executable to use (default: `.venv-ui/bin/mlflow` of this checkout, then PATH)."""
STORE_DIR = "mlflow"
IMPORTED_MARKER = "imported.json"
_SPANS_PER_REQUEST = 500
_METRICS_PER_REQUEST = 1000  # MLflow's log-batch limit
_PARAMS_PER_REQUEST = 100
_PARAM_VALUE_LIMIT = 500
_SPAN_KINDS = {"INTERNAL": 1, "SERVER": 2, "CLIENT": 3, "PRODUCER": 4, "CONSUMER": 5}
_STATUS_CODES = {"UNSET": 0, "OK": 1, "ERROR": 2}


class UIError(RuntimeError):
    """The UI cannot be started or fed: the message says what to do."""


def find_mlflow(explicit: str | Path | None = None) -> Path:
    """The `mlflow` executable: `explicit`, `$AGENTGYM_MLFLOW`, this checkout's `.venv-ui`, or PATH."""
    candidates: list[Path] = []
    if explicit:
        candidates.append(Path(explicit))
    elif os.environ.get(MLFLOW_ENV):
        candidates.append(Path(os.environ[MLFLOW_ENV]))
    else:
        repo = Path(__file__).resolve().parents[3]
        candidates.append(repo / ".venv-ui" / "bin" / "mlflow")
        found = shutil.which("mlflow")
        if found:
            candidates.append(Path(found))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    tried = ", ".join(str(c) for c in candidates) or "nothing"
    raise UIError(
        f"MLflow is not installed (tried {tried}): run `make setup-ui` (or `pip install mlflow=={MLFLOW_VERSION}` "
        f"in an environment of its own) and pass --mlflow PATH or set {MLFLOW_ENV}"
    )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class MlflowServer:
    """`mlflow server` on loopback with its store in `store_dir`; a context manager that stops it on exit."""

    store_dir: Path
    port: int = 0
    mlflow: Path | None = None
    ready_timeout_s: float = 120.0
    log_path: Path | None = None
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> MlflowServer:
        executable = self.mlflow or find_mlflow()
        self.port = self.port or free_port()
        self.store_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_path or self.store_dir / "server.log"
        argv = [
            str(executable), "server", "--host", "127.0.0.1", "--port", str(self.port),
            "--backend-store-uri", f"sqlite:///{(self.store_dir / 'mlflow.db').resolve()}",
            "--default-artifact-root", str((self.store_dir / "artifacts").resolve()),
            "--workers", "1",
        ]  # fmt: skip
        # No usage pings; no background job workers (huey consumers for MLflow's online scoring, unused here,
        # which would take CPU from the run on a small machine).
        env = {
            **os.environ,
            "MLFLOW_DISABLE_TELEMETRY": "true",
            "DO_NOT_TRACK": "true",
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        }
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=self.store_dir
            )
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise UIError(f"mlflow server exited with {self.process.returncode}; its log ends:\n{tail}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise UIError(f"mlflow server did not answer {self.url}/health within {self.ready_timeout_s:g} s ({log_path})")

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        # gunicorn/uvicorn workers are the server's children: signal the whole session it leads.
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(5)

    def __enter__(self) -> MlflowServer:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class MlflowClient:
    """The REST calls the platform makes to an MLflow tracking server."""

    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, timeout=timeout_s)

    def close(self) -> None:
        self.http.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as error:
            raise UIError(f"MLflow at {self.url} did not answer {path}: {error}") from error
        if response.status_code >= 400:
            raise UIError(f"MLflow {path} answered {response.status_code}: {response.text[:500]}")
        body = response.json() if response.content else {}
        return body if isinstance(body, dict) else {}

    def experiment_id(self, name: str) -> str:
        """The id of experiment `name`, created when it does not exist."""
        response = self.http.get("/api/2.0/mlflow/experiments/get-by-name", params={"experiment_name": name})
        if response.status_code == 200:
            return str(response.json()["experiment"]["experiment_id"])
        return str(self._call("POST", "/api/2.0/mlflow/experiments/create", json={"name": name})["experiment_id"])

    def create_run(self, experiment_id: str, name: str, tags: Mapping[str, str] | None = None) -> str:
        body = {
            "experiment_id": experiment_id,
            "run_name": name,
            "start_time": int(time.time() * 1000),
            "tags": [{"key": k, "value": v} for k, v in (tags or {}).items()],
        }
        return str(self._call("POST", "/api/2.0/mlflow/runs/create", json=body)["run"]["info"]["run_id"])

    def log_batch(
        self,
        run_id: str,
        metrics: Iterable[Mapping[str, Any]] = (),
        params: Mapping[str, str] | None = None,
    ) -> None:
        metric_list = list(metrics)
        for start in range(0, len(metric_list), _METRICS_PER_REQUEST):
            chunk = metric_list[start : start + _METRICS_PER_REQUEST]
            self._call("POST", "/api/2.0/mlflow/runs/log-batch", json={"run_id": run_id, "metrics": chunk})
        items = [{"key": k, "value": v} for k, v in (params or {}).items()]
        for start in range(0, len(items), _PARAMS_PER_REQUEST):
            params_chunk = items[start : start + _PARAMS_PER_REQUEST]
            self._call("POST", "/api/2.0/mlflow/runs/log-batch", json={"run_id": run_id, "params": params_chunk})

    def finish_run(self, run_id: str, status: str = "FINISHED") -> None:
        body = {"run_id": run_id, "status": status, "end_time": int(time.time() * 1000)}
        self._call("POST", "/api/2.0/mlflow/runs/update", json=body)

    def log_spans(self, experiment_id: str, spans: list[dict[str, Any]], run_id: str | None = None) -> None:
        """Spans (as `agentgym.telemetry` writes them) over OTLP/HTTP JSON, a trace's spans in one request."""
        headers = {"x-mlflow-experiment-id": experiment_id, "content-type": "application/json"}
        if run_id:
            headers["x-mlflow-run-id"] = run_id
        for batch in _batches_by_trace(spans, _SPANS_PER_REQUEST):
            self._call("POST", "/v1/traces", content=json.dumps(otlp_json(batch)), headers=headers)


def _batches_by_trace(spans: list[dict[str, Any]], size: int) -> Iterator[list[dict[str, Any]]]:
    """Batches of about `size` spans that never split a trace (MLflow completes a trace at its root span)."""
    by_trace: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for span in spans:
        by_trace[span["trace_id"]].append(span)
    batch: list[dict[str, Any]] = []
    for members in by_trace.values():
        if batch and len(batch) + len(members) > size:
            yield batch
            batch = []
        batch.extend(members)
    if batch:
        yield batch


def _any_value(value: Any) -> dict[str, Any]:
    """An OTLP JSON AnyValue (64-bit ints are strings in OTLP JSON)."""
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        return {"doubleValue": value}
    if isinstance(value, list | tuple):
        return {"arrayValue": {"values": [_any_value(v) for v in value]}}
    return {"stringValue": str(value)}


def _attributes(attributes: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [{"key": key, "value": _any_value(value)} for key, value in attributes.items()]


def otlp_json(spans: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """An OTLP `ExportTraceServiceRequest` in JSON (ids in hex) for spans as `span_to_dict` writes them."""
    by_service: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for span in spans:
        otlp: dict[str, Any] = {
            "traceId": span["trace_id"],
            "spanId": span["span_id"],
            "name": span["name"],
            "kind": _SPAN_KINDS.get(str(span.get("kind", "INTERNAL")), 1),
            "startTimeUnixNano": str(span["start_unix_nano"]),
            "endTimeUnixNano": str(span["end_unix_nano"]),
            "attributes": _attributes(span.get("attributes") or {}),
            "events": [
                {
                    "name": event["name"],
                    "timeUnixNano": str(span["end_unix_nano"]),
                    "attributes": _attributes(event.get("attributes") or {}),
                }
                for event in span.get("events") or []
            ],
            "status": {"code": _STATUS_CODES.get(str(span.get("status", "UNSET")), 0)},
        }
        if span.get("parent_span_id"):
            otlp["parentSpanId"] = span["parent_span_id"]
        if span.get("status_description"):
            otlp["status"]["message"] = span["status_description"]
        by_service[str(span.get("service") or "agentgym")].append(otlp)
    return {
        "resourceSpans": [
            {
                "resource": {"attributes": _attributes({"service.name": service})},
                "scopeSpans": [{"scope": {"name": "agentgym"}, "spans": members}],
            }
            for service, members in by_service.items()
        ]
    }


def metric_records(row: Mapping[str, Any], timestamp_ms: int | None = None) -> list[dict[str, Any]]:
    """MLflow metrics from one `metrics.jsonl` row: numbers at top level, per-environment stats as `env/<name>/<key>`.

    SFT rows (`sft/...` keys) count their own steps (`sft/sft_step`); RL rows use the trainer's `step`.
    """
    timestamp = timestamp_ms if timestamp_ms is not None else int(time.time() * 1000)
    sft = "sft/sft_step" in row
    step = int(row.get("sft/sft_step", 0) if sft else row.get("step", 0))
    records = []

    def add(key: str, value: Any) -> None:
        if isinstance(value, bool):
            value = float(value)
        if isinstance(value, int | float) and value == value and abs(value) != float("inf"):
            records.append({"key": key, "value": float(value), "timestamp": timestamp, "step": step})

    for key, value in row.items():
        if key == "step" or (sft and key == "sft/sft_step"):
            continue
        if key == "env" and isinstance(value, Mapping):
            for env_name, stats in value.items():
                if isinstance(stats, Mapping):
                    for stat, number in stats.items():
                        add(f"env/{env_name}/{stat}", number)
            continue
        add(key, value)
    return records


def spec_params(spec: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """The spec flattened to MLflow parameters (`algorithm.name` -> `grpo`), values cut to MLflow's limit."""
    params: dict[str, str] = {}
    for key, value in spec.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            params.update(spec_params(value, f"{name}."))
        else:
            text = json.dumps(value) if isinstance(value, list) else str(value)
            params[name] = text[:_PARAM_VALUE_LIMIT]
    return params


@dataclass(frozen=True)
class ImportResult:
    experiment_id: str
    run_id: str
    spans: int
    traces: int
    metrics: int


def run_name_of(run_dir: Path) -> str:
    spec_path = run_dir / "spec.yaml"
    if spec_path.exists():
        document = yaml.safe_load(spec_path.read_text()) or {}
        name = (document.get("metadata") or {}).get("name")
        if name:
            return str(name)
    return run_dir.resolve().name


def start_mlflow_run(client: MlflowClient, run_dir: Path) -> tuple[str, str]:
    """The experiment (named after the run) and a new MLflow run holding the spec as parameters."""
    name = run_name_of(run_dir)
    experiment_id = client.experiment_id(name)
    run_id = client.create_run(experiment_id, name, {"agentgym.run_dir": str(run_dir.resolve())})
    spec_path = run_dir / "spec.yaml"
    if spec_path.exists():
        document = yaml.safe_load(spec_path.read_text()) or {}
        client.log_batch(run_id, params=spec_params(document.get("spec") or {}))
    return experiment_id, run_id


def final_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The held-out evals of `status.json` (`eval/<phase>/success` ...), at the trainer's last step."""
    status_path = run_dir / "status.json"
    if not status_path.exists():
        return []
    status = json.loads(status_path.read_text())
    metrics = {k: v for k, v in (status.get("metrics") or {}).items() if k.startswith("eval/")}
    return metric_records({"step": int(status.get("step") or 0), **metrics})


def import_run(client: MlflowClient, run_dir: Path) -> ImportResult:
    """Load a finished run directory into MLflow: traces, per-step metrics, evals, the spec."""
    traces_path = run_dir / "telemetry" / "traces.jsonl"
    if not (run_dir / "spec.yaml").exists() and not traces_path.exists():
        raise UIError(f"{run_dir} is not a run directory (no spec.yaml, no telemetry/traces.jsonl)")
    experiment_id, run_id = start_mlflow_run(client, run_dir)
    spans = list(read_spans(traces_path))
    client.log_spans(experiment_id, spans, run_id)
    logged = MetricsFollower(client, run_id, run_dir / "metrics.jsonl").poll()  # the whole file, as a live run does
    evals = final_metrics(run_dir)
    client.log_batch(run_id, evals)
    client.finish_run(run_id)
    return ImportResult(experiment_id, run_id, len(spans), len({s["trace_id"] for s in spans}), logged + len(evals))


def mark_imported(store_dir: Path, result: ImportResult) -> None:
    marker = {"experiment_id": result.experiment_id, "run_id": result.run_id, "spans": result.spans}
    (store_dir / IMPORTED_MARKER).write_text(json.dumps(marker))


def imported(store_dir: Path) -> dict[str, Any] | None:
    """What an earlier import (or live run) put in this store, or None when it holds nothing yet."""
    path = store_dir / IMPORTED_MARKER
    return json.loads(path.read_text()) if path.exists() else None


def experiment_url(server_url: str, experiment_id: str, view: str = "traces") -> str:
    return f"{server_url}/#/experiments/{experiment_id}/{view}"


class MetricsFollower:
    """Logs `metrics.jsonl` rows to an MLflow run as the trainer appends them (poll; a torn last line waits)."""

    def __init__(self, client: MlflowClient, run_id: str, path: Path) -> None:
        self.client = client
        self.run_id = run_id
        self.path = path
        self._offset = 0

    def poll(self) -> int:
        """Log the complete rows written since the last poll; returns how many metric points that was."""
        if not self.path.exists():
            return 0
        with self.path.open("rb") as handle:
            handle.seek(self._offset)
            data = handle.read()
        complete = data[: data.rfind(b"\n") + 1]
        if not complete:
            return 0
        self._offset += len(complete)
        records = []
        for line in complete.decode("utf-8", errors="replace").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict):
                records += metric_records(row)
        if records:
            self.client.log_batch(self.run_id, records)
        return len(records)


@dataclass
class LiveUI:
    """`agentgym run --ui`: the server, the MLflow run, and the environment that sends every process's spans."""

    run_dir: Path
    port: int = 0
    mlflow: Path | None = None
    server: MlflowServer | None = None
    client: MlflowClient | None = None
    experiment_id: str = ""
    run_id: str = ""
    follower: MetricsFollower | None = None

    def start(self) -> dict[str, str]:
        """Start the UI; returns the environment the run's processes need to export their spans to it."""
        store = self.run_dir / STORE_DIR
        self.server = MlflowServer(store, port=self.port, mlflow=self.mlflow).start()
        self.client = MlflowClient(self.server.url)
        self.experiment_id, self.run_id = start_mlflow_run(self.client, self.run_dir)
        self.follower = MetricsFollower(self.client, self.run_id, self.run_dir / "metrics.jsonl")
        headers = f"x-mlflow-experiment-id={self.experiment_id},x-mlflow-run-id={self.run_id}"
        return {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{self.server.url}/v1/traces",
            "OTEL_EXPORTER_OTLP_TRACES_HEADERS": headers,
        }

    @property
    def url(self) -> str:
        assert self.server is not None
        return experiment_url(self.server.url, self.experiment_id)

    def poll(self) -> None:
        if self.follower is not None:
            try:
                self.follower.poll()
            except UIError as error:  # the UI is a view: a failed write must not end the run
                print(f"agentgym ui: {error}", file=sys.stderr)

    def finish(self, succeeded: bool) -> None:
        if self.client is None or self.server is None:
            return
        try:
            self.poll()
            self.client.log_batch(self.run_id, final_metrics(self.run_dir))
            self.client.finish_run(self.run_id, "FINISHED" if succeeded else "FAILED")
            marker = ImportResult(self.experiment_id, self.run_id, -1, -1, -1)
            mark_imported(self.server.store_dir, marker)
        finally:
            self.client.close()
            self.server.stop()
