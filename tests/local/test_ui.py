"""`agentgym ui`: a run's spans and metrics in a real MLflow server, looked at in headless Chromium.

The conversions (spans -> OTLP JSON, metrics.jsonl rows -> MLflow metrics) are checked by hand; the slow test
writes a run directory with the real OpenTelemetry SDK and the platform's JSONL exporter, imports it into MLflow
(`.venv-ui`, `make setup-ui`), and finds one episode's turns in the trace view.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind

from agentgym.local.ui import _batches_by_trace, find_mlflow, metric_records, otlp_json, spec_params
from agentgym.telemetry import JsonlSpanExporter, read_spans

AGENTGYM = [sys.executable, "-m", "agentgym.cli"]
REPO = Path(__file__).resolve().parents[2]
MLFLOW = REPO / ".venv-ui" / "bin" / "mlflow"
# CI always runs it (scripts/test.sh sets MLflow up); elsewhere it needs `make setup-ui`.
needs_mlflow = pytest.mark.skipif(
    not (MLFLOW.exists() or os.environ.get("AGENTGYM_MLFLOW") or os.environ.get("CI")),
    reason="MLflow not set up (make setup-ui)",
)


def test_spans_become_otlp_json_with_hex_ids_typed_values_and_one_resource_per_service() -> None:
    spans = [
        {
            "name": "invoke_agent agentgym-babyai", "trace_id": "ab" * 16, "span_id": "01" * 8, "parent_span_id": None,
            "service": "agentgym-rollout", "kind": "INTERNAL", "start_unix_nano": 10, "end_unix_nano": 30,
            "status": "ERROR", "status_description": "env died",
            "attributes": {"agentgym.reward": 0.5, "agentgym.turns": 3, "agentgym.success": False, "x": ["a"]},
            "events": [{"name": "exception", "attributes": {"exception.type": "RuntimeError"}}],
        },
        {
            "name": "train_step", "trace_id": "ab" * 16, "span_id": "02" * 8, "parent_span_id": "03" * 8,
            "service": "trainer", "kind": "CONSUMER", "start_unix_nano": 1, "end_unix_nano": 2, "status": "UNSET",
            "status_description": None, "attributes": {}, "events": [],
        },
    ]  # fmt: skip
    body = otlp_json(spans)
    services = [r["resource"]["attributes"][0]["value"]["stringValue"] for r in body["resourceSpans"]]
    assert services == ["agentgym-rollout", "trainer"]
    agent = body["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert (agent["traceId"], agent["spanId"], "parentSpanId" in agent) == ("ab" * 16, "01" * 8, False)
    assert (agent["kind"], agent["startTimeUnixNano"], agent["endTimeUnixNano"]) == (1, "10", "30")
    assert agent["status"] == {"code": 2, "message": "env died"}
    assert agent["attributes"] == [
        {"key": "agentgym.reward", "value": {"doubleValue": 0.5}},
        {"key": "agentgym.turns", "value": {"intValue": "3"}},
        {"key": "agentgym.success", "value": {"boolValue": False}},
        {"key": "x", "value": {"arrayValue": {"values": [{"stringValue": "a"}]}}},
    ]
    assert agent["events"][0]["name"] == "exception" and agent["events"][0]["timeUnixNano"] == "30"
    step = body["resourceSpans"][1]["scopeSpans"][0]["spans"][0]
    assert (step["kind"], step["parentSpanId"], step["status"]) == (5, "03" * 8, {"code": 0})


def test_batches_never_split_a_trace() -> None:
    spans = [{"trace_id": t, "n": i} for i, t in enumerate("aaabbbbcdd")]
    batches = list(_batches_by_trace(spans, 4))
    assert [[s["trace_id"] for s in b] for b in batches] == [list("aaa"), list("bbbb"), list("cdd")]


def test_metric_rows_become_mlflow_metrics_at_their_own_steps() -> None:
    rl = {"step": 2, "policy_loss": -0.25, "horizon": 5, "ok": True, "nan": float("nan"), "note": "x",
          "env": {"babyai": {"success": 0.5, "label": "y"}}}  # fmt: skip
    records = metric_records(rl, timestamp_ms=7)
    assert records == [
        {"key": "policy_loss", "value": -0.25, "timestamp": 7, "step": 2},
        {"key": "horizon", "value": 5.0, "timestamp": 7, "step": 2},
        {"key": "ok", "value": 1.0, "timestamp": 7, "step": 2},
        {"key": "env/babyai/success", "value": 0.5, "timestamp": 7, "step": 2},
    ]
    sft = {"step": 0, "sft/sft_loss": 3.5, "sft/sft_step": 4.0, "env": {}}
    assert metric_records(sft, timestamp_ms=1) == [{"key": "sft/sft_loss", "value": 3.5, "timestamp": 1, "step": 4}]


def test_the_spec_flattens_to_parameters() -> None:
    params = spec_params({"algorithm": {"name": "grpo", "groupSize": 8}, "curriculum": {"horizons": [5, 8]}})
    assert params == {"algorithm.name": "grpo", "algorithm.groupSize": "8", "curriculum.horizons": "[5, 8]"}
    assert len(spec_params({"a": "x" * 900})["a"]) == 500


def test_missing_mlflow_and_non_run_directories_are_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "spec.yaml").write_text("metadata: {name: r}\n")
    result = subprocess.run(
        [*AGENTGYM, "ui", str(tmp_path), "--mlflow", str(tmp_path / "nope")], capture_output=True, text=True, timeout=60
    )
    said = " ".join(result.stderr.split())  # rich wraps long lines
    assert result.returncode == 2 and "MLflow is not installed" in said and "run `make setup-ui`" in said
    empty = tmp_path / "empty"
    empty.mkdir()
    result = subprocess.run([*AGENTGYM, "ui", str(empty)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "not a run directory" in " ".join(result.stderr.split())
    with pytest.raises(Exception, match="MLflow is not installed"):
        find_mlflow(tmp_path / "nope")
    # `agentgym run --ui` without MLflow: refused before anything starts or is written.
    run_spec = tmp_path / "run.yaml"
    document = {
        "apiVersion": "agentgym.io/v1alpha1", "kind": "TrainingRun", "metadata": {"name": "r"},
        "spec": {"model": {"name": "builtin:tiny"}, "environments": [{"name": "babyai"}]},
    }  # fmt: skip
    run_spec.write_text(yaml.safe_dump(document))
    run_dir = tmp_path / "never"
    env = {**os.environ, "AGENTGYM_MLFLOW": str(tmp_path / "nope")}
    result = subprocess.run(
        [*AGENTGYM, "run", str(run_spec), "--run-dir", str(run_dir), "--ui"], capture_output=True, text=True,
        timeout=60, env=env,
    )  # fmt: skip
    assert result.returncode == 2 and "--ui: MLflow is not installed" in " ".join(result.stderr.split())
    assert not run_dir.exists()


def write_run(run_dir: Path) -> None:
    """A small run directory as `agentgym run` leaves it, its spans from the real SDK and exporter."""
    (run_dir / "telemetry").mkdir(parents=True)
    (run_dir / "spec.yaml").write_text(
        yaml.safe_dump({"metadata": {"name": "ui-check"}, "spec": {"algorithm": {"name": "grpo", "groupSize": 2}}})
    )
    exporters = {}
    for service in ("trainer", "agentgym-rollout"):
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        exporter = JsonlSpanExporter(run_dir / "telemetry" / "traces.jsonl")
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        exporters[service] = provider.get_tracer("test")
    trainer, rollout = exporters["trainer"], exporters["agentgym-rollout"]
    with (
        trainer.start_as_current_span("train_step", attributes={"agentgym.step": 0}),
        rollout.start_as_current_span("process rollout_request", kind=SpanKind.CONSUMER),
    ):
        attributes = {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "agentgym-babyai",
                      "gen_ai.conversation.id": "ui-check/0/0/0", "agentgym.task_id": "GoToRedBall/s1"}  # fmt: skip
        with rollout.start_as_current_span("invoke_agent agentgym-babyai", attributes=attributes) as agent:
            for turn in (1, 2):
                with rollout.start_as_current_span(f"turn {turn}", attributes={"agentgym.turn": turn}):
                    chat = {"gen_ai.operation.name": "chat", "gen_ai.usage.input_tokens": 40 * turn,
                            "gen_ai.usage.output_tokens": 6, "gen_ai.request.model": "tiny"}  # fmt: skip
                    with rollout.start_as_current_span("chat tiny", kind=SpanKind.CLIENT, attributes=chat):
                        time.sleep(0.01)
                    tool = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "babyai.step"}
                    with rollout.start_as_current_span("execute_tool babyai.step", attributes=tool):
                        time.sleep(0.005)
            agent.set_attributes({"agentgym.reward": 1.0, "agentgym.termination": "TERMINATION_DONE"})
    rows = [{"step": s, "policy_loss": 0.5 - 0.1 * s, "env": {"babyai": {"success": 0.25 * s}}} for s in range(3)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "status.json").write_text(json.dumps({"step": 3, "metrics": {"eval/end/success": 0.6}}))


def history(url: str, run_id: str, key: str) -> list[tuple[int, float]]:
    body = httpx.get(f"{url}/api/2.0/mlflow/metrics/get-history", params={"run_id": run_id, "metric_key": key}).json()
    return sorted((int(m["step"]), float(m["value"])) for m in body.get("metrics", []))


def distinct_colours(png: Path) -> int:
    from PIL import Image

    with Image.open(png) as image:
        small = image.convert("RGB").resize((200, 130))
        return len({small.getpixel((x, y)) for x in range(200) for y in range(130)})


async def look_at_the_trace(url: str, screenshot: Path) -> str:
    from playwright.async_api import async_playwright

    async with async_playwright() as playwright:
        browser = await playwright.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        try:
            page = await browser.new_page(viewport={"width": 1400, "height": 900})
            await page.goto(url)
            # The trace list (CSS, not roles: MLflow's first-visit popover makes the rest aria-hidden).
            row = page.locator('div[role="row"]:has(input[aria-label^="Select trace"])').first
            await row.wait_for(timeout=60_000)
            tip = page.get_by_text("Got it")  # the first-visit popover over the list
            if await tip.count():
                await tip.first.click()
            await row.locator('[role="cell"]').nth(1).click()  # open the (only) trace: its span tree
            await page.get_by_text("invoke_agent agentgym-babyai").first.wait_for(timeout=60_000)
            await page.get_by_text("turn 2").first.wait_for(timeout=30_000)
            await page.screenshot(path=str(screenshot))
            return await page.inner_text("body")
        finally:
            await browser.close()


@pytest.mark.slow
@needs_mlflow
async def test_a_run_is_imported_and_its_episode_read_as_turns_in_mlflow(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write_run(run_dir)
    assert len(list(read_spans(run_dir / "telemetry"))) == 9
    server = subprocess.Popen(
        [*AGENTGYM, "ui", str(run_dir), "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert server.stdout is not None
        lines: list[str] = []
        for line in server.stdout:
            lines.append(line)
            if "serving" in line:
                break
        output = "".join(lines)
        assert "imported 9 spans (1 traces) and 7 metric points" in output, output
        traces_url = re.search(r"traces:\s+(\S+)", output)
        assert traces_url is not None, output
        base = traces_url.group(1).split("/#/")[0]
        experiment = httpx.get(f"{base}/api/2.0/mlflow/experiments/get-by-name", params={"experiment_name": "ui-check"})
        experiment_id = experiment.json()["experiment"]["experiment_id"]
        runs = httpx.post(f"{base}/api/2.0/mlflow/runs/search", json={"experiment_ids": [experiment_id]}).json()
        [run] = runs["runs"]
        run_id = run["info"]["run_id"]
        assert run["info"]["status"] == "FINISHED"
        assert {p["key"]: p["value"] for p in run["data"]["params"]}["algorithm.name"] == "grpo"
        assert history(base, run_id, "policy_loss") == [(0, 0.5), (1, 0.4), (2, pytest.approx(0.3))]
        assert history(base, run_id, "env/babyai/success") == [(0, 0.0), (1, 0.25), (2, 0.5)]
        assert history(base, run_id, "eval/end/success") == [(3, 0.6)]

        text = await look_at_the_trace(traces_url.group(1), tmp_path / "trace.png")
        for name in ("invoke_agent agentgym-babyai", "turn 1", "turn 2", "chat tiny", "execute_tool babyai.step"):
            assert name in text, name
        assert distinct_colours(tmp_path / "trace.png") > 20  # a rendered page, not a blank one
        print(f"screenshot: {tmp_path / 'trace.png'}")
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    assert server.returncode == 0
    # Opened again, the store already holds the run: nothing is imported twice.
    again = subprocess.run(
        [*AGENTGYM, "ui", str(run_dir), "--port", "0", "--import-only"], capture_output=True, text=True, timeout=180
    )
    assert again.returncode == 0, again.stderr
    assert "imported" not in again.stdout and "traces:" in again.stdout
