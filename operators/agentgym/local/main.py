"""`agentgym run`'s composition root: the local runner, its progress display, and signal handling.

The CLI (operators/agentgym/cli/main.py) validates the command line and the run directory, then calls
`run_locally`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path

import yaml
from rich.console import Console
from rich.live import Live

from agentgym.local.live import Progress
from agentgym.local.run_eval import RunEvalSettings
from agentgym.local.runner import LocalRunner
from agentgym.local.ui import LiveUI, UIError
from agentgym.spec import TrainingRun


async def _follow_metrics(ui: LiveUI, every_s: float = 2.0) -> None:
    while True:
        await asyncio.to_thread(ui.poll)
        await asyncio.sleep(every_s)


def run_locally(
    run: TrainingRun,
    directory: Path,
    *,
    resume: bool,
    eval_settings: RunEvalSettings,
    live: bool,
    console: Console,
    ui: LiveUI | None = None,
) -> int:
    """Run `run` in `directory` until it finishes or SIGINT/SIGTERM; print its outcome. Returns the exit code."""
    directory.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        handlers=[logging.FileHandler(directory / "runner.log")],
    )
    if ui is not None:
        # The spec is written first so the MLflow run carries it; the children inherit the export settings.
        (directory / "spec.yaml").write_text(yaml.safe_dump(run.to_document(), sort_keys=False))
        try:
            os.environ.update(ui.start())
        except UIError as error:  # nothing of the run has started yet
            console.print(f"[bold red]error:[/] --ui: {error}", soft_wrap=True)
            return 2
        console.print(f"[bold]UI[/] {ui.url}", soft_wrap=True)
    runner = LocalRunner(run, directory, resume=resume, eval_settings=eval_settings)
    progress = Progress(run.metadata.name, run.spec.trainer.total_steps, console, directory / "steps.log")
    runner.status.listeners.append(progress.update)
    console.print(f"[bold]agentgym run[/] {run.metadata.name} -> {directory}  (logs: {directory / 'logs'})")

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        if ui is None:
            return await runner.run_until_done(stop)
        follower = asyncio.create_task(_follow_metrics(ui))
        try:
            return await runner.run_until_done(stop)
        finally:
            follower.cancel()

    if live and console.is_terminal:
        with Live(console=console, refresh_per_second=2) as panel:
            progress.live = panel
            code = asyncio.run(main())
    else:
        code = asyncio.run(main())
    status = runner.status.status
    if ui is not None:
        try:
            ui.finish(succeeded=code == 0)
        except UIError as error:  # the run's own record (files, checkpoints) is complete either way
            console.print(f"[yellow]the UI could not be finalised:[/] {error}", soft_wrap=True)
        console.print(f"UI stopped; reopen it with `agentgym ui {directory}`", soft_wrap=True)
    console.print(f"[bold]{status.phase}[/] at step {status.step}; status: {directory / 'status.json'}")
    for line in runner.summary_lines():  # held-out success before training, after SFT, at the end
        console.print(line, soft_wrap=True)
    return code
