"""The trainer process: ``python -m agentgym.trainer.entrypoint --run run.yaml --nats-url nats://...``.

What the trainer image runs (and what the DeepSpeed launcher starts on every GPU). The config
comes from a TrainingRun YAML (``--run``) or a JSON dump of ``RLTrainerConfig`` (``--config``);
NATS from ``--nats-url``, the spec's ``messaging.natsUrl`` or ``$AGENTGYM_NATS_URL``. Task catalogs
come from the environment packages in-process, or from env services named with ``--env-url
NAME=URL`` (or the spec's ``environments[].url``). SIGTERM and
SIGINT stop the loop after the step in progress is checkpointed. The trainer computes on the main thread and
the loop runs beside it (``agentgym.trainer.main_thread`` says why).

Under the DeepSpeed launcher (``WORLD_SIZE`` > 1) every rank runs this: rank 0 runs the loop above,
the others follow it (``agentgym.trainer.distributed``); only rank 0 connects to NATS.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

from agentgym.cpus import configure_torch_threads, prefer_sleeping_omp_threads, trainer_threads

prefer_sleeping_omp_threads()  # before the trainer's modules import torch (libgomp reads it once)

from agentgym.trainer.config import RLTrainerConfig  # noqa: E402

__all__ = ["config_from_args", "main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentgym-trainer", description=__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", type=Path, help="TrainingRun YAML")
    source.add_argument("--config", type=Path, help="RLTrainerConfig as JSON")
    parser.add_argument("--nats-url", default=None)
    parser.add_argument("--output-dir", type=Path, default=None)
    parser.add_argument("--run-name", default=None, help="Run name (default: the TrainingRun's metadata.name)")
    parser.add_argument(
        "--env-url",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="Read NAME's task catalog from this env service (no environment engine needed in the trainer)",
    )
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # DeepSpeed launcher
    return parser


def _with_env_urls(config: RLTrainerConfig, pairs: list[str]) -> RLTrainerConfig:
    urls = {}
    for pair in pairs:
        name, sep, url = pair.partition("=")
        if not sep or not name or not url:
            raise SystemExit(f"--env-url expects NAME=URL, got {pair!r}")
        urls[name] = url
    unknown = set(urls) - {e.name for e in config.environments}
    if unknown:
        raise SystemExit(f"--env-url names environments the run does not use: {', '.join(sorted(unknown))}")
    config.environments = [dataclasses.replace(e, url=urls.get(e.name, e.url)) for e in config.environments]
    return config


def config_from_args(args: argparse.Namespace) -> tuple[RLTrainerConfig, str | None]:
    """(config, NATS URL from the spec if any)."""
    config, url = _config_and_url(args)
    return _with_env_urls(config, list(getattr(args, "env_url", None) or [])), url


def _config_and_url(args: argparse.Namespace) -> tuple[RLTrainerConfig, str | None]:
    if args.run is not None:
        from agentgym.spec import load_training_run

        run = load_training_run(args.run)
        name = args.run_name or run.metadata.name
        config = RLTrainerConfig.from_spec(run.spec, run=name, output_dir=args.output_dir)
        return config, run.spec.messaging.nats_url
    data: dict[str, Any] = json.loads(Path(args.config).read_text())
    if args.output_dir is not None:
        data["output_dir"] = str(args.output_dir)
    if args.run_name:
        data["run"] = args.run_name
    if "adam_betas" in data:
        data["adam_betas"] = tuple(data["adam_betas"])
    return RLTrainerConfig(**data), None


def main(argv: list[str] | None = None) -> int:
    args, _ = _parser().parse_known_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config, spec_url = config_from_args(args)
    from agentgym.trainer.distributed import follow, init_data_parallel, world_size_from_env

    world = world_size_from_env()
    try:
        configure_torch_threads(trainer_threads())  # a pod's CPU limit or a cpuset, not the node's cores
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    if world > 1 and config.backend != "deepspeed":
        raise SystemExit(f"WORLD_SIZE={world}: training on several ranks needs trainer.backend: deepspeed")
    from agentgym.messaging import default_nats_url

    url = args.nats_url or spec_url or default_nats_url()
    if not url:
        raise SystemExit("no NATS URL: pass --nats-url, set messaging.natsUrl or $AGENTGYM_NATS_URL")
    from agentgym.trainer.trainer import RLTrainer

    data_parallel = init_data_parallel(args.local_rank)
    if not data_parallel.is_main:
        follower = RLTrainer(config, data_parallel=data_parallel)
        calls = follow(follower)
        follower.close()
        logging.getLogger(__name__).info("rank %d: made %d calls; done", data_parallel.rank, calls)
        return 0
    from agentgym.telemetry import TELEMETRY_DIR_VAR, setup_telemetry
    from agentgym.trainer.loop import run_training

    # OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set; else $AGENTGYM_TELEMETRY_DIR, else <run dir>/telemetry
    directory = None if os.environ.get(TELEMETRY_DIR_VAR) else Path(config.output_dir) / "telemetry"
    telemetry = setup_telemetry("trainer", directory=directory)

    from agentgym.trainer.main_thread import MainThreadExecutor, run_loop_beside

    # The trainer is built, computes and saves on this (the main) thread; the loop runs on another.
    compute = MainThreadExecutor()
    try:
        trainer = RLTrainer(config, data_parallel=data_parallel)
        run_loop_beside(lambda stop: run_training(config, url, stop=stop, trainer=trainer, compute=compute), compute)
        trainer.close()
    finally:
        telemetry.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
