"""CPU learning check (#7): does GRPO raise BabyAI success by >= 20 points within 5 minutes?

One process, the platform's real parts without the processes between them: BabyAI environments
(in-process), the HF inference engine (`agentgym.inference.engine.Engine`), the rollout loop
(`agentgym.rollout.episode.run_episode`, the same token splicing as the rollout worker) and the
trainer (`RLTrainer`: the SFT warm-up, then `train_step` with GRPO).

1. Warm start (not timed against the budget): the tiny random model is fine-tuned on the BabyAI
   bot's demonstrations of ``--sft-tasks`` (1024) tasks for ``--sft-steps`` (32) steps of 8
   (`RLTrainer.sft`, the `sftWarmupSteps` path of a run), optimiser reset after. Each demonstrated
   reply is the action line alone (``--no-sft-thoughts``, the quickstart's ``sftThoughts: false``):
   the bot gives actions only, and a thought restating the action made the policy sample, and the
   update train on, ~29 tokens a turn instead of 8, each a chance at temperature 1 to leave the
   format. A quarter of an epoch: the policy has the format, but about 70 % of its turns are invalid
   (it acts before it has looked: ``go to red ball 1`` with no red ball in view); validation success
   0.42-0.47. The quickstart's 64 steps start GRPO at 0.75 instead, and five minutes take that to
   0.92 (+17): the ceiling, not the learning, then bounds the gain this check measures.
2. Held-out success before RL, at the last horizon of the schedule, ``--eval-samples`` seeded
   episodes per task, on two sets:
   - validation (the target's set): ``--validation-tasks`` (150) tasks of ``train-easy``, each on a
     layout of its own, none demonstrated in the warm-up and none drawn by GRPO;
   - ``test-easy``: its 75 tasks, which have only 25 layouts (the three easy levels of one seed share
     the room, the objects and the start), too few for a 20-point claim; printed alongside.
   A layout's episodes are correlated, so standard errors are over layouts.
3. GRPO within ``--budget-s`` seconds of wall time (rollouts, update, weight load all counted; a step
   starts only if the longest step so far would end within the budget):
   ``--tasks`` train tasks x ``--group`` samples per step, fresh tasks every step, under the
   ScalingInter schedule ``--horizons`` (``--stage-steps`` steps per stage).

The defaults are the recipe of ``examples/quickstart.yaml`` (but for the warm-up's length, above):
observations without the action list,
GRPO, sequence-mean loss, 0.1 per invalid action, and the best settings measured for this check:
lr 2e-4 (5e-5 moves too little in 5 minutes; 2e-4 was unstable with one optimiser step per step, not
since the clipped ratio bounds the later ones), four optimiser steps per step of 32 episodes
(``--mini-batch 8``), turn-level validity credit of weight 1 (``--turn-validity-coef``) in the groups
where some sample succeeded (``--turn-validity-needs-success``; in every group, one seed of five lost 32
points: with no success in a group, validity alone taught the policy to stop trying ``go to``), step-level
groups over anchor states of weight 1 (``--step-group-coef``, GiGPO) and bf16 autocast in the update
(``--bf16``; float32 on a CPU without bf16 units, see ``cpu_bf16_bench.py``). The trainer forwards
each group's shared prompt once per mini-batch (``share_prompts``, on by default), and the prefix
that the prompts of a packed row share (BabyAI's system prompt and instructions, 256 tokens) once per
row (``share_prompt_prefixes``): 0.49 of the tokens of a copy per sample (``shared_prompt_bench.py``).
4. Held-out success after RL on the same tasks with the same seeds.

Prints each step, then before / after / gain with standard errors (the gain's paired by layout),
against the target (gain >= 20 points on the validation layouts within 300 s of GRPO). The baseline
is the warm-started policy measured in the same run.

``--warm-start DIR`` saves the warmed-up policy to DIR, and later runs with the same DIR start from it
(no warm-up): RL settings compared on one baseline.

Usage: python benchmarks/grpo_learning_bench.py [--budget-s 300] [--sft-steps 32] [--lr 2e-4] [--seed 0] ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench helpers next to this script
from shared_prompt_bench import scratch_dir

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
from agentgym.trainer.sft import sample_task_ids
from agentgym.trainer.trainer import RLTrainer

ENVIRONMENT = "babyai"
TARGET_POINTS = 20.0
TARGET_SECONDS = 300.0
SFT_TASKS_FILE = "sft_task_ids.json"  # in a --warm-start folder: the tasks it was fine-tuned on
SFT_SETTINGS_FILE = "sft_settings.json"  # and the warm-up flags it was made with
SFT_FLAGS = ("sft_steps", "sft_tasks", "sft_batch", "sft_lr", "sft_thoughts")


class EnginePolicy:
    """The rollout loop's `Policy` over an in-process inference engine."""

    provider = "agentgym"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    @property
    def model_name(self) -> str | None:
        return self.engine.served_model_name

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
        return Sample(
            list(sample.token_ids),
            list(sample.logprobs),
            sample.finish_reason,
            out.policy_version,
            model=self.engine.served_model_name,
            cached_tokens=out.cached_prompt_tokens,
        )


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
            top_p=args.top_p,
            seed=derive_seed(seed_label, task_id, k),
            policy_version=engine.policy_version,
        )
        return await run_episode(request, sessions, policy, chat, template, settings)

    return list(await asyncio.gather(*(one(t, k) for t in task_ids for k in range(samples))))


def layout_of(task_id: str) -> str:
    """The layout of a BabyAI task: the easy levels of one seed share it (``GoToRedBall/s7`` -> ``s7``)."""
    return task_id.rsplit("/", 1)[-1]


def success_by_layout(trajectories: Sequence[rl_pb2.Trajectory]) -> dict[str, float]:
    """Success rate per layout: the unit of the standard errors (a layout's episodes are correlated)."""
    by_layout: dict[str, list[bool]] = defaultdict(list)
    for t in trajectories:
        by_layout[layout_of(t.task_id)].append(bool(t.success))
    return {layout: sum(v) / len(v) for layout, v in by_layout.items()}


def mean_with_error(values: Sequence[float]) -> tuple[float, float]:
    """Mean and its standard error."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))


def success_with_error(trajectories: Sequence[rl_pb2.Trajectory]) -> tuple[float, float]:
    """Mean success and its standard error over layouts."""
    return mean_with_error(list(success_by_layout(trajectories).values()))


def paired_gain(before: Sequence[rl_pb2.Trajectory], after: Sequence[rl_pb2.Trajectory]) -> tuple[float, float]:
    """Gain in success and its standard error, paired by layout (the same tasks before and after)."""
    rate_before, rate_after = success_by_layout(before), success_by_layout(after)
    return mean_with_error([rate_after[layout] - rate_before[layout] for layout in rate_before])


def split_train_and_validation(
    catalog: Any, validation_size: int, excluded_task_ids: Sequence[str]
) -> tuple[list[str], list[str]]:
    """Held-out validation tasks of ``train-easy`` (one per layout, levels in turn) and the tasks GRPO draws from.

    Validation takes layouts from the end of the split, none that the SFT warm-up demonstrated
    (``excluded_task_ids``); GRPO never draws a task of a validation layout.
    """
    split = list(catalog.task_ids("train-easy"))
    excluded = {layout_of(t) for t in excluded_task_ids}
    levels = sorted({t.rsplit("/", 1)[0] for t in split})
    by_layout: dict[str, dict[str, str]] = defaultdict(dict)
    for task_id in split:
        by_layout[layout_of(task_id)][task_id.rsplit("/", 1)[0]] = task_id
    validation: list[str] = []
    for layout in reversed(list(by_layout)):
        if len(validation) == validation_size:
            break
        if layout not in excluded:
            validation.append(by_layout[layout][levels[len(validation) % len(levels)]])
    if len(validation) < validation_size:
        free = len(set(by_layout) - excluded)
        raise ValueError(f"{validation_size} validation layouts asked; only {free} are not in the warm-up's demos")
    held_out = {layout_of(t) for t in validation}
    return validation, [t for t in split if layout_of(t) not in held_out]


def invalid_turn_rate(trajectories: Sequence[rl_pb2.Trajectory]) -> float:
    turns = [turn for t in trajectories for turn in t.turns]
    return sum(turn.invalid_action for turn in turns) / max(len(turns), 1)


async def main(args: argparse.Namespace) -> int:
    torch.manual_seed(args.seed)
    env_settings = {} if args.list_actions else {"list_actions": False}
    warm_start = Path(args.warm_start) if args.warm_start else None
    reuse_warm_start = warm_start is not None and (warm_start / "config.json").is_file()
    catalog = envs.environment_class(ENVIRONMENT).catalog()
    test_tasks = list(catalog.task_ids("test-easy", limit=args.eval_tasks))
    sft_task_ids = sample_task_ids(ENVIRONMENT, "train-easy", args.sft_tasks, args.seed)
    if reuse_warm_start:
        assert warm_start is not None
        sft_task_ids = json.loads((warm_start / SFT_TASKS_FILE).read_text())
    try:
        validation_tasks, train_tasks = split_train_and_validation(catalog, args.validation_tasks, sft_task_ids)
    except ValueError as error:
        print(f"error: --validation-tasks: {error}", file=sys.stderr)
        return 2
    work = scratch_dir("grpo-learning-")  # the engine's weights, several hundred MB
    group_estimator = args.algorithm in ("grpo", "rloo")  # the turn- and step-level credit is theirs alone
    config = RLTrainerConfig(
        model=str(warm_start) if reuse_warm_start else "builtin:tiny",
        output_dir=work,
        algorithm=args.algorithm,
        group_size=args.group,
        learning_rate=args.lr,
        kl_coef=args.kl,
        dpo_beta=args.dpo_beta,
        mini_batch_size=args.mini_batch,
        mini_batches_by_group=args.mini_batches_by_group,
        drop_uniform_groups=args.drop_uniform_groups and group_estimator,
        loss_aggregation=args.aggregation,
        invalid_action_penalty=args.invalid_action_penalty,
        turn_validity_coef=args.turn_validity_coef if group_estimator else 0.0,
        turn_validity_needs_success=args.turn_validity_needs_success,
        step_group_coef=args.step_group_coef if group_estimator else 0.0,
        step_group_gamma=args.step_group_gamma,
        negative_advantage_scale=args.negative_advantage_scale,
        adam_eps=args.adam_eps,
        environments=[EnvironmentConfig(ENVIRONMENT, "train-easy", config=env_settings)],
        curriculum={"kind": "scaling_inter", "horizons": args.horizons, "stage_steps": args.stage_steps},
        max_context_tokens=args.max_context_tokens,
        sft_learning_rate=args.sft_lr,
        sft_tasks=args.sft_tasks,
        sft_batch_size=args.sft_batch,
        sft_thoughts=args.sft_thoughts,
        micro_batch_tokens=args.micro_batch_tokens,
        bf16=args.bf16,
        tensorboard=False,
        otel_metrics=False,
        seed=args.seed,
    )
    print(f"# {args.algorithm} learning check on BabyAI easy, tiny model, {os.cpu_count()} CPUs; work dir {work}")
    print("settings: " + " ".join(f"{k}={v}" for k, v in sorted(vars(args).items())), flush=True)
    trainer = RLTrainer(config, write_metrics=False)
    print(f"update precision: {'bf16 autocast' if trainer.autocast_dtype else 'float32'}", flush=True)
    chat = ChatTokenizer(trainer.tokenizer)
    engine = Engine(str(trainer.current_policy_dir), max_batch_size=64)

    async def serve_current_policy() -> None:
        await engine.load_weights(str(trainer.export_weights()), trainer.policy_version)

    async def evaluate(label: str) -> dict[str, list[rl_pb2.Trajectory]]:
        """Held-out success on the validation layouts and on ``test-easy``, at the last horizon."""
        episodes = {}
        for name, tasks in (("validation", validation_tasks), ("test-easy", test_tasks)):
            started = time.perf_counter()
            played = await play(
                engine, chat, env_settings, tasks, args.eval_samples, args, -1, f"eval/{name}", args.horizons[-1]
            )
            rate, error = success_with_error(played)
            layouts = len(success_by_layout(played))
            print(
                f"eval {label}, {name}: success {rate:.3f} ± {error:.3f} ({len(played)} episodes of {len(tasks)} tasks"
                f" on {layouts} layouts, invalid turns {invalid_turn_rate(played):.2f},"
                f" {time.perf_counter() - started:.0f} s)",
                flush=True,
            )
            episodes[name] = played
        return episodes

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
            (warm_start / SFT_TASKS_FILE).write_text(json.dumps(sft_task_ids))
            (warm_start / SFT_SETTINGS_FILE).write_text(json.dumps(sft_settings(args)))
            print(f"  saved to {warm_start} for --warm-start in later runs", flush=True)
    before = await evaluate("after the SFT warm-up (before GRPO)")

    rng = random.Random(args.seed)
    grpo_started = time.perf_counter()
    step = 0
    longest_step = 0.0
    # A step starts only if the longest one so far would still end within the budget: all of GRPO fits in it.
    while step < args.max_steps and time.perf_counter() - grpo_started + longest_step <= args.budget_s:
        step_started = time.perf_counter()
        tasks = rng.sample(train_tasks, args.tasks)
        horizon = trainer.horizon  # the ScalingInter stage of this step
        episodes = await play(engine, chat, env_settings, tasks, args.group, args, step, f"{args.seed}/{step}", horizon)
        rollout_seconds = time.perf_counter() - step_started
        metrics = trainer.train_step(episodes)
        await serve_current_policy()
        train = metrics.train
        rate = sum(t.success for t in episodes) / len(episodes)
        trained = f"  trained on {metrics.counts['used']}" if args.drop_uniform_groups else ""
        print(
            f"step {step}: horizon {horizon}  train success {rate:.2f}{trained}  rollout {rollout_seconds:.1f} s"
            f"  update {train['step_time_s']:.1f} s"
            f"  entropy {train.get('entropy', 0.0):.3f}  kl {train.get('kl', 0.0):.4f}"
            f"  clip {train.get('clip_fraction', 0.0):.3f}  grad norm {train.get('grad_norm', 0.0):.2f}"
            f"  [{time.perf_counter() - grpo_started:.0f} s]",
            flush=True,
        )
        step += 1
        longest_step = max(longest_step, time.perf_counter() - step_started)
    grpo_seconds = time.perf_counter() - grpo_started
    after = await evaluate(f"after {step} GRPO steps")
    engine.close()
    if args.save_policy:
        shutil.copytree(trainer.export_weights(), args.save_policy)
        print(f"policy after GRPO saved to {args.save_policy}", flush=True)

    print()
    gains = {}
    for name in ("validation", "test-easy"):
        rate_before, error_before = success_with_error(before[name])
        rate_after, error_after = success_with_error(after[name])
        gain, gain_error = paired_gain(before[name], after[name])
        gains[name] = 100.0 * gain
        print(
            f"{name:>10}: {rate_before:.3f} ± {error_before:.3f} after SFT -> {rate_after:.3f} ± {error_after:.3f}"
            f" after GRPO, gain {100.0 * gain:+.1f} ± {100.0 * gain_error:.1f} points (paired by layout)"
        )
    ok = gains["validation"] >= TARGET_POINTS and grpo_seconds <= TARGET_SECONDS
    print(f"{grpo_seconds:.0f} s of GRPO ({step} steps)")
    print(
        f"target: >= {TARGET_POINTS:.0f} points on the validation layouts within {TARGET_SECONDS:.0f} s"
        f" -> {'PASS' if ok else 'FAIL'}"
    )
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    return 0 if ok else 1


def sft_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The flags a warm start depends on."""
    return {name: getattr(args, name) for name in SFT_FLAGS}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=TARGET_SECONDS, help="GRPO wall-time budget")
    parser.add_argument("--max-steps", type=int, default=1000)
    parser.add_argument("--sft-steps", type=int, default=32)
    parser.add_argument("--sft-tasks", type=int, default=1024, help="tasks demonstrated in the warm-up")
    parser.add_argument("--sft-batch", type=int, default=8)
    parser.add_argument("--sft-lr", type=float, default=1e-3)
    parser.add_argument(
        "--sft-thoughts",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="demonstrated replies think before the action (a generic thought restating it); default: the action alone",
    )
    parser.add_argument(
        "--algorithm",
        choices=["grpo", "rloo", "rft", "dpo"],
        default="grpo",
        help="the update after the warm-up (rft, dpo: no turn- or step-level credit); the target is GRPO's",
    )
    parser.add_argument("--dpo-beta", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--kl", type=float, default=0.0)
    parser.add_argument("--adam-eps", type=float, default=1e-8)
    parser.add_argument("--mini-batch", type=int, default=8, help="trajectories per optimiser step")
    parser.add_argument(
        "--mini-batches-by-group",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="mini-batches of whole groups (fewer prompt tokens; one group per optimiser step at the defaults)",
    )
    parser.add_argument(
        "--drop-uniform-groups",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="leave out groups whose samples all succeeded or all failed (DAPO's dynamic sampling)",
    )
    parser.add_argument("--aggregation", default="seq-mean-token-mean")
    parser.add_argument("--invalid-action-penalty", type=float, default=0.1)
    parser.add_argument("--turn-validity-coef", type=float, default=1.0)
    parser.add_argument(
        "--turn-validity-needs-success",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="validity credit only in groups where some sample succeeded (--no-...: in every group)",
    )
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
    parser.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling, in training and in the evals (below 1 destabilises GRPO: see RolloutSpec.top_p)",
    )
    parser.add_argument("--max-tokens-per-turn", type=int, default=36)
    parser.add_argument("--max-context-tokens", type=int, default=2048)
    parser.add_argument(
        "--micro-batch-tokens", type=int, default=4096, help="packed row size (a mini-batch of 8 in one or two rows)"
    )
    parser.add_argument("--eval-samples", type=int, default=2)
    parser.add_argument("--eval-tasks", type=int, default=None, help="first N tasks of test-easy (default: all 75)")
    parser.add_argument(
        "--validation-tasks", type=int, default=150, help="held-out train-easy tasks, one per layout (the target's set)"
    )
    parser.add_argument("--list-actions", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--warm-start",
        default=None,
        help="folder for the SFT'd policy: saved there after the warm-up, reused (no warm-up) when it exists",
    )
    parser.add_argument("--save-policy", default=None, help="new folder for the policy after GRPO (to inspect it)")
    args = parser.parse_args(argv)
    if args.save_policy and Path(args.save_policy).exists():
        parser.error(f"--save-policy {args.save_policy}: exists; pick a new folder")
    for flag in ("sft_steps", "sft_tasks", "sft_batch"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, not {getattr(args, flag)}")
    if args.sft_lr <= 0:
        parser.error(f"--sft-lr must be > 0, not {args.sft_lr}")
    if args.validation_tasks < 1:
        parser.error(f"--validation-tasks must be >= 1, not {args.validation_tasks}")
    if not 0.0 < args.top_p <= 1.0:
        parser.error(f"--top-p must be in (0, 1], not {args.top_p}")
    if args.turn_validity_coef < 0:
        parser.error(f"--turn-validity-coef must be >= 0, not {args.turn_validity_coef}")
    if args.dpo_beta <= 0:
        parser.error(f"--dpo-beta must be > 0, not {args.dpo_beta}")
    if args.step_group_coef < 0:
        parser.error(f"--step-group-coef must be >= 0, not {args.step_group_coef}")
    if not 0.0 <= args.step_group_gamma <= 1.0:
        parser.error(f"--step-group-gamma must be in [0, 1], not {args.step_group_gamma}")
    warm = Path(args.warm_start) if args.warm_start else None
    if warm is not None and warm.exists() and not (warm / "config.json").is_file():
        # Checked now: the warm-up would run for minutes and then fail to save there.
        parser.error(f"--warm-start {warm}: exists but holds no saved policy (no config.json); pick a new folder")
    if warm is not None and (warm / "config.json").is_file() and not (warm / SFT_TASKS_FILE).is_file():
        # Without it the validation layouts could include demonstrated ones.
        parser.error(f"--warm-start {warm}: no {SFT_TASKS_FILE} (the tasks it was fine-tuned on); make it anew")
    if warm is not None and (warm / SFT_SETTINGS_FILE).is_file():
        # A reused warm start runs no warm-up: flags that differ from the ones it was made with would be ignored.
        made = json.loads((warm / SFT_SETTINGS_FILE).read_text())
        given = sft_settings(args)
        differ = [f"--{k.replace('_', '-')} {made.get(k)} (not {v})" for k, v in given.items() if made.get(k) != v]
        if differ:
            parser.error(f"--warm-start {warm} was made with {', '.join(differ)}; pass those, or pick a new folder")
    return args


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
