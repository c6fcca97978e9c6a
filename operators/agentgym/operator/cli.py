"""`agentgym operator ...`: run the operator, check a deployed platform (the Helm test), render a run's children."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

operator_app = typer.Typer(help="The TrainingRun operator (kopf).", no_args_is_help=True)
err_console = Console(stderr=True)


def _namespaces(given: list[str] | None) -> list[str]:
    if given:
        return given
    from_env = [n.strip() for n in os.environ.get("WATCH_NAMESPACES", "").split(",") if n.strip()]
    if from_env:
        return from_env
    own = os.environ.get("POD_NAMESPACE")
    return [own] if own else ["default"]


@operator_app.command("run")
def run(
    config: Annotated[Path | None, typer.Option(help="Operator config (default: $AGENTGYM_OPERATOR_CONFIG)")] = None,
    namespace: Annotated[
        list[str] | None, typer.Option("--namespace", "-n", help="Watch this namespace (repeatable)")
    ] = None,
    all_namespaces: Annotated[bool, typer.Option("--all-namespaces", "-A", help="Watch the whole cluster")] = False,
    liveness: Annotated[str | None, typer.Option(help="e.g. http://0.0.0.0:8080/healthz")] = None,
    verbose: bool = False,
) -> None:
    """Reconcile TrainingRuns (namespaces: --namespace, else $WATCH_NAMESPACES, else $POD_NAMESPACE)."""
    import kopf

    from agentgym.operator.config import ConfigError, load_config
    from agentgym.operator.handlers import build_registry

    try:
        loaded = load_config(config)
    except ConfigError as error:
        err_console.print(f"[bold red]error:[/] {error}")
        raise typer.Exit(2) from None
    kopf.configure(verbose=verbose, log_format=kopf.LogFormat.PLAIN)
    watched = [] if all_namespaces else _namespaces(namespace)
    err_console.print(f"agentgym operator: watching {'all namespaces' if all_namespaces else ', '.join(watched)}")
    kopf.run(
        registry=build_registry(loaded.resync_seconds),
        memo=kopf.Memo(config=loaded),
        standalone=True,
        clusterwide=all_namespaces,
        namespaces=watched,
        liveness_endpoint=liveness,
    )


@operator_app.command("check")
def check(
    operator_url: Annotated[str, typer.Option(help="The operator's liveness URL")],
    nats_url: Annotated[str, typer.Option(help="NATS (credentials from NATS_USER/NATS_PASSWORD or NATS_TOKEN)")],
    timeout: float = 30.0,
) -> None:
    """Check that the operator and NATS (with JetStream) answer; what `helm test` runs."""
    from agentgym.operator.checks import check_platform

    problems = asyncio.run(check_platform(operator_url, nats_url, timeout=timeout))
    for problem in problems:
        err_console.print(f"[red]✗[/] {problem}")
    if problems:
        raise typer.Exit(1)
    err_console.print("[green]✓[/] operator and NATS answer")


@operator_app.command("render")
def render(
    run_file: Annotated[Path, typer.Argument(help="A TrainingRun YAML file")],
    namespace: str = "default",
    config: Annotated[Path | None, typer.Option(help="Operator config")] = None,
) -> None:
    """Print the children the operator would create for a run (no cluster needed)."""
    import yaml

    from agentgym.operator.config import ConfigError, load_config
    from agentgym.operator.manifests import RunInputs, build_children, checkpoint_claim
    from agentgym.spec import SpecError, load_training_run

    try:
        training_run = load_training_run(run_file)
        loaded = load_config(config)
    except (SpecError, ConfigError) as error:
        err_console.print(f"[bold red]error:[/] {error}")
        raise typer.Exit(2) from None
    inputs = RunInputs(
        run=training_run, namespace=namespace, config=loaded, nats_url=loaded.nats.url, inference_checkpoint=None
    )
    documents = build_children(inputs)
    claim = checkpoint_claim(inputs)
    if claim is not None:
        documents.append(claim)
    sys.stdout.write(yaml.safe_dump_all(documents, sort_keys=False))
