"""CPU learning check (#7): does GRPO raise BabyAI success by >= 20 points within 5 minutes?

One process, the platform's real parts without the processes between them: BabyAI environments
(in-process), the HF inference engine (`agentgym.inference.engine.Engine`), the rollout loop
(`agentgym.rollout.episode.run_episode`, the same token splicing as the rollout worker) and the
trainer (`RLTrainer`: the SFT warm-up, then `train_step` with GRPO).

1. Warm start (not timed against the budget): the tiny random model is fine-tuned on the BabyAI
   bot's demonstrations (`RLTrainer.sft`, the `sftWarmupSteps` path of a run), optimiser reset after.
2. Held-out success before RL: every task of ``test-easy`` (75), ``--eval-samples`` seeded episodes
   each, at the last horizon of the schedule. The standard error is over tasks.
3. GRPO for ``--budget-s`` seconds of wall time (rollouts, update, weight load all counted):
   ``--tasks`` train tasks x ``--group`` samples per step, fresh tasks every step, under the
   ScalingInter schedule ``--horizons`` (``--stage-steps`` steps per stage).

The defaults are the recipe of ``examples/quickstart.yaml`` (observations without the action list,
GRPO with one optimiser step per 32 episodes, sequence-mean loss, 0.1 per invalid action) with the best
stable settings measured for this check: lr 1e-4 (the quickstart's 5e-5 moves too little in 22 steps),
turn-level validity credit of weight 1 (``--turn-validity-coef``), step-level groups over anchor
states of weight 1 (``--step-group-coef``, GiGPO) and bf16 autocast in the update (``--bf16``, ~10 %
more steps in the budget); the quickstart has none of the last three.
4. Held-out success after RL on the same episodes (same seeds).

Prints each step, then before / after / gain with standard errors, against the target (gain >= 20
points within 300 s of GRPO). The baseline is the warm-started policy measured in the same run.

``--warm-start DIR`` saves the warmed-up policy to DIR, and later runs with the same DIR start from it
(no warm-up): RL settings compared on one baseline.

Usage: python benchmarks/grpo_learning_bench.py [--budget-s 300] [--sft-steps 60] [--lr 1e-4] ...
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import shutil
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from agentgym import envs
from agentgym.envs.client import Opened, Stepped
from agentgym.inference.engine import Engine, SamplingParams
from agentgym.proto import rl_pb2
from agentgym.rollout.episode import EpisodeSettings, Sample, run_episode
from agentgym.rollout.prompts import template_for
from agentgym.rollout.tokens import ChatTokenizer
from agentgym.seeding import derive_seed
from agentgym.trainer.config import EnvironmentConfig, RLTrainerConfig
from agentgym.trainer.loop import build_warmup_examples
from agentgym.trainer.trainer import RLTrainer

ENVIRONMENT = "babyai"
TARGET_POINTS = 20.0
TARGET_SECONDS = 300.0


class EnginePolicy:
    """The rollout loop's `Policy` over an in-process inference engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def sample(
        self,
        prompt_ids: list[int],
        *,
        max_tokens: int,
        temperature: float,
        top_p: float,
        stop_token_ids: Sequence[int],
        seed: int | None,
    ) -> Sample:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            stop_token_ids=tuple(stop_token_ids),
            seed=seed,
        )
        out = await self.engine.generate(prompt_ids, params)
        sample = out.samples[0]
        return Sample(list(sample.token_ids), list(sample.logprobs), sample.finish_reason, out.policy_version)


class InProcessEnvironments:
    """The rollout loop's `EnvSession` over environments in this process (one per episode)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings
        self.live: dict[str, envs.Environment] = {}

    async def create(self, task_id: str | None = None, split: str | None = None, index: int | None = None) -> Opened:
        env = envs.make(ENVIRONMENT, **self.settings)
        reset = env.reset(str(task_id))
        episode_id = uuid.uuid4().hex
        self.live[episode_id] = env
        return Opened(episode_id, task_id, reset.observation, reset.available_actions, dict(reset.info))

    async def step(self, episode_id: str, action: str) -> Stepped:
        result = self.live[episode_id].step(action)
        return Stepped(
            result.observation,
            result.reward,
            result.score,
            result.done,
            result.truncated,
            result.available_actions,
            dict(result.info),
        )

    async def close(self, episode_id: str) -> None:
        env = self.live.pop(episode_id, None)
        if env is not None:
            env.close()


async def play(
    engine: Engine,
    chat: ChatTokenizer,
    env_settings: dict[str, Any],
    task_ids: Sequence[str],
    samples: int,
    args: argparse.Namespace,
    step: int,
    seed_label: str,
    horizon: int,
) -> list[rl_pb2.Trajectory]:
    """``samples`` episodes of each task, concurrently, each seeded by ``(seed_label, task, k)``.

    Hashed seeds: episodes never share a random stream (see `agentgym.seeding`).
    """
    sessions = InProcessEnvironments(env_settings)
    policy = EnginePolicy(engine)
    template = template_for(ENVIRONMENT)
    settings = EpisodeSettings(max_context_tokens=args.max_context_tokens)

    async def one(task_id: str, k: int) -> rl_pb2.Trajectory:
        request = rl_pb2.RolloutRequest(
            run="grpo-learning-bench",
            request_id=f"{step}/{task_id}/{k}",
            step=max(step, 0),
            group_id=f"{step}/{task_id}",
            sample_index=k,
            environment=ENVIRONMENT,
            task_id=task_id,
            max_turns=horizon,
            max_tokens_per_turn=args.max_tokens_per_turn,
            temperature=args.temperature,
            top_p=1.0,
            seed=derive_seed(seed_label, task_id, k),
            policy_version=engine.policy_version,
        )
        return await run_episode(request, sessions, policy, chat, template, settings)

    return list(await asyncio.gather(*(one(t, k) for t in task_ids for k in range(samples))))


def success_with_error(trajectories: Sequence[rl_pb2.Trajectory]) -> tuple[float, float]:
    """Mean success and its standard error over tasks (a task's samples are correlated)."""
    by_task: dict[str, list[bool]] = defaultdict(list)
    for t in trajectories:
        by_task[t.task_id].append(bool(t.success))
    rates = [sum(v) / len(v) for v in by_task.values()]
    mean = sum(rates) / len(rates)
    if len(rates) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((r - mean) ** 2 for r in rates) / (len(rates) - 1) / len(rates))


def invalid_turn_rate(trajectories: Sequence[rl_pb2.Trajectory]) -> float:
    turns = [turn for t in trajectories for turn in t.turns]
    return sum(turn.invalid_action for turn in turns) / max(len(turns), 1)


async def main(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    env_settings = {} if args.list_actions else {"list_actions": False}
    work = Path(tempfile.mkdtemp(prefix="grpo-learning-"))
    warm_start = Path(args.warm_start) if args.warm_start else None
    reuse_warm_start = warm_start is not None and (warm_start / "config.json").is_file()
    config = RLTrainerConfig(
        model=str(warm_start) if reuse_warm_start else "builtin:tiny",
        output_dir=work,
        algorithm="grpo",
        group_size=args.group,
        learning_rate=args.lr,
        kl_coef=args.kl,
        mini_batch_size=args.mini_batch,
        loss_aggregation=args.aggregation,
        invalid_action_penalty=args.invalid_action_penalty,
        turn_validity_coef=args.turn_validity_coef,
        step_group_coef=args.step_group_coef,
        step_group_gamma=args.step_group_gamma,
        negative_advantage_scale=args.negative_advantage_scale,
        adam_eps=args.adam_eps,
        environments=[EnvironmentConfig(ENVIRONMENT, "train-easy", config=env_settings)],
        curriculum={"kind": "scaling_inter", "horizons": args.horizons, "stage_steps": args.stage_steps},
        max_context_tokens=args.max_context_tokens,
        sft_learning_rate=args.sft_lr,
        sft_tasks=args.sft_tasks,
        sft_batch_size=args.sft_batch,
        micro_batch_tokens=args.micro_batch_tokens,
        bf16=args.bf16,
        tensorboard=False,
        otel_metrics=False,
        seed=args.seed,
    )
    print(f"# GRPO learning check on BabyAI easy, tiny model, {os.cpu_count()} CPUs; work dir {work}")
    print("settings: " + " ".join(f"{k}={v}" for k, v in sorted(vars(args).items())), flush=True)
    trainer = RLTrainer(config, write_metrics=False)
    chat = ChatTokenizer(trainer.tokenizer)
    engine = Engine(str(trainer.current_policy_dir), max_batch_size=64)
    catalog = envs.environment_class(ENVIRONMENT).catalog()
    eval_tasks = list(catalog.task_ids("test-easy", limit=args.eval_tasks))

    async def serve_current_policy() -> None:
        await engine.load_weights(str(trainer.export_weights()), trainer.policy_version)

    async def evaluate(label: str) -> tuple[float, float]:
        started = time.perf_counter()
        episodes = await play(
            engine, chat, env_settings, eval_tasks, args.eval_samples, args, -1, "eval", args.horizons[-1]
        )
        rate, error = success_with_error(episodes)
        print(
            f"eval {label}: success {rate:.3f} ± {error:.3f} ({len(episodes)} episodes of {len(eval_tasks)} tasks, "
            f"invalid turns {invalid_turn_rate(episodes):.2f}, {time.perf_counter() - started:.0f} s)",
            flush=True,
        )
        return rate, error

    if reuse_warm_start:
        print(f"warm start: the SFT'd policy saved in {warm_start} (no warm-up run)", flush=True)
    else:
        started = time.perf_counter()
        examples = build_warmup_examples(config, trainer.tokenizer)
        history = trainer.sft(examples, args.sft_steps)
        await serve_current_policy()
        sft_seconds = time.perf_counter() - started
        loss = history[-1]["sft_loss"]
        print(f"SFT warm-up: {args.sft_steps} steps on {len(examples)} demonstrations, loss {loss:.3f}")
        print(f"  {sft_seconds:.0f} s (not counted in the GRPO budget)", flush=True)
        if warm_start is not None:
            shutil.copytree(trainer.export_weights(), warm_start)
            print(f"  saved to {warm_start} for --warm-start in later runs", flush=True)
    before, before_error = await evaluate("after the SFT warm-up (before GRPO)")

    rng = random.Random(args.seed)
    train_tasks = list(catalog.task_ids("train-easy"))
    grpo_started = time.perf_counter()
    step = 0
    while step < args.max_steps and time.perf_counter() - grpo_started < args.budget_s:
        step_started = time.perf_counter()
        tasks = rng.sample(train_tasks, args.tasks)
        horizon = trainer.horizon  # the ScalingInter stage of this step
        episodes = await play(engine, chat, env_settings, tasks, args.group, args, step, f"{args.seed}/{step}", horizon)
        rollout_seconds = time.perf_counter() - step_started
        metrics = trainer.train_step(episodes)
        await serve_current_policy()
        train = metrics.train
        rate = sum(t.success for t in episodes) / len(episodes)
        print(
            f"step {step}: horizon {horizon}  train success {rate:.2f}  rollout {rollout_seconds:.1f} s"
            f"  update {train['step_time_s']:.1f} s"
            f"  entropy {train.get('entropy', 0.0):.3f}  kl {train.get('kl', 0.0):.4f}"
            f"  clip {train.get('clip_fraction', 0.0):.3f}  grad norm {train.get('grad_norm', 0.0):.2f}"
            f"  [{time.perf_counter() - grpo_started:.0f} s]",
            flush=True,
        )
        step += 1
    grpo_seconds = time.perf_counter() - grpo_started
    after, after_error = await evaluate(f"after {step} GRPO steps")
    engine.close()

    gain = 100.0 * (after - before)
    gain_error = 100.0 * math.hypot(before_error, after_error)
    ok = gain >= TARGET_POINTS and grpo_seconds <= TARGET_SECONDS + 60.0  # the last step may overrun the budget
    print()
    print(f"success after SFT (baseline): {before:.3f} ± {before_error:.3f}")
    print(f"success after GRPO:           {after:.3f} ± {after_error:.3f}")
    print(f"gain: {gain:+.1f} ± {gain_error:.1f} points in {grpo_seconds:.0f} s of GRPO ({step} steps)")
    print(f"target: >= {TARGET_POINTS:.0f} points within {TARGET_SECONDS:.0f} s -> {'PASS' if ok else 'FAIL'}")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    return 0 if ok else 1


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=TARGET_SECONDS, help="GRPO wall-time budget")
    parser.add_argument("--max-steps", type=int, default=1000)
    parser.add_argument("--sft-steps", type=int, default=64)
    parser.add_argument("--sft-tasks", type=int, default=128)
    parser.add_argument("--sft-batch", type=int, default=8)
    parser.add_argument("--sft-lr", type=float, default=1e-3)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--kl", type=float, default=0.0)
    parser.add_argument("--adam-eps", type=float, default=1e-8)
    parser.add_argument("--mini-batch", type=int, default=32, help="trajectories per optimiser step")
    parser.add_argument("--aggregation", default="seq-mean-token-mean")
    parser.add_argument("--invalid-action-penalty", type=float, default=0.1)
    parser.add_argument("--turn-validity-coef", type=float, default=1.0)
    parser.add_argument("--negative-advantage-scale", type=float, default=1.0)
    parser.add_argument("--step-group-coef", type=float, default=1.0, help="GiGPO step-level groups (0: off)")
    parser.add_argument("--step-group-gamma", type=float, default=0.95)
    parser.add_argument(
        "--bf16", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast in the update"
    )
    parser.add_argument("--tasks", type=int, default=4, help="train tasks per GRPO step")
    parser.add_argument("--group", type=int, default=8, help="episodes per task (the GRPO group)")
    parser.add_argument(
        "--horizons", type=lambda text: [int(h) for h in text.split(",")], default=[2, 3, 5], help="ScalingInter stages"
    )
    parser.add_argument("--stage-steps", type=int, default=4, help="GRPO steps per ScalingInter stage")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens-per-turn", type=int, default=36)
    parser.add_argument("--max-context-tokens", type=int, default=2048)
    parser.add_argument("--micro-batch-tokens", type=int, default=2048)
    parser.add_argument("--eval-samples", type=int, default=2)
    parser.add_argument("--eval-tasks", type=int, default=None, help="first N tasks of test-easy (default: all 75)")
    parser.add_argument("--list-actions", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--warm-start",
        default=None,
        help="folder for the SFT'd policy: saved there after the warm-up, reused (no warm-up) when it exists",
    )
    args = parser.parse_args(argv)
    if args.step_group_coef < 0:
        parser.error(f"--step-group-coef must be >= 0, not {args.step_group_coef}")
    if not 0.0 <= args.step_group_gamma <= 1.0:
        parser.error(f"--step-group-gamma must be in [0, 1], not {args.step_group_gamma}")
    warm = Path(args.warm_start) if args.warm_start else None
    if warm is not None and warm.exists() and not (warm / "config.json").is_file():
        # Checked now: the warm-up would run for minutes and then fail to save there.
        parser.error(f"--warm-start {warm}: exists but holds no saved policy (no config.json); pick a new folder")
    return args


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
