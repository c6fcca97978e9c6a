"""``RLTrainerConfig``: everything the trainer needs, built from a ``TrainingRunSpec`` or by hand.

    config = RLTrainerConfig.from_spec(run.spec, run=run.metadata.name)
    config = RLTrainerConfig(model="builtin:tiny", output_dir="runs/demo", algorithm="grpo", group_size=4)

Fields mirror the spec (``algorithm.*``, ``rollout.*``, ``trainer.*``, ``curriculum``) plus trainer
options the spec does not carry (reward convention, old-logprob recomputation, SFT settings,
collector timeouts); their defaults are documented on each field.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from agentgym.trainer.curriculum import HorizonSchedule, build_schedule
from agentgym.trainer.rewards import OutcomeReward, RewardConfig

__all__ = ["EnvironmentConfig", "RLTrainerConfig", "checkpoint_root_from_uri"]

Algorithm = Literal["grpo", "ppo", "rloo", "reinforce_plus_plus", "rft", "dpo"]


@dataclass(frozen=True)
class EnvironmentConfig:
    """One environment the run samples tasks from."""

    name: str
    split: str = "train"
    weight: float = 1.0
    url: str | None = None
    """A running env service: its task catalog is read over HTTP (no environment engine needed here)."""
    config: dict[str, Any] = field(default_factory=dict)
    """The environment's settings (the spec's ``config``): the SFT warm-up replays demonstrations with them."""


def checkpoint_root_from_uri(uri: str) -> Path:
    """A local directory from ``file://path`` or a plain path (remote schemes are not handled here)."""
    if "://" in uri and not uri.startswith("file://"):
        raise ValueError(f"checkpoint URI {uri!r}: only local paths and file:// are supported by the trainer")
    return Path(uri.removeprefix("file://")).expanduser()


@dataclass
class RLTrainerConfig:
    # --- run and model -------------------------------------------------------------------------
    model: str = "builtin:tiny"
    """Initial policy: an HF folder or ``builtin:tiny`` / ``builtin:smollm2-135m``; also the reference policy."""
    tokenizer: str | None = None
    """Tokenizer folder when it differs from ``model`` (saved into every checkpoint)."""
    output_dir: str | Path = "runs/local"
    """Run directory: ``checkpoints/``, ``weights/``, ``metrics.jsonl``, ``tensorboard/``."""
    run: str = "local"
    """Run name (NATS subjects, request ids, metric attributes)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype on GPU; CPU always keeps float32 parameters (``bf16`` autocasts there, given bf16 units)."""
    attn_implementation: str | None = None
    """``sdpa_packed`` (default: sdpa over only the blocks a packed row's tokens may see, see
    ``agentgym.trainer.packed_attention``), ``sdpa`` (a dense row mask), ``eager``, or
    ``flash_attention_2`` (GPU, packed via position ids; no shared prompts)."""
    device: str | None = None
    """``cpu`` / ``cuda`` / ``cuda:N``; default: cuda when available and ``gpus`` > 0, else cpu."""
    max_context_tokens: int = 4096
    """Longest sequence built for SFT from expert demonstrations (spec.model.maxContextTokens)."""

    # --- algorithm (spec.algorithm) ------------------------------------------------------------
    algorithm: Algorithm = "grpo"
    group_size: int = 8
    learning_rate: float = 1e-6
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    """Dual-clip constant (> 1) for negative advantages; None disables."""
    kl_coef: float = 0.001
    """KL to the reference (initial) policy; 0 disables the reference model (rft: unused; dpo: ``dpo_beta``)."""
    dpo_beta: float = 0.1
    """``dpo``: the DPO temperature (how far the policy may move from the reference for a preference margin)."""
    kl_type: Literal["k1", "k2", "k3"] = "k3"
    kl_as: Literal["loss", "reward"] = "loss"
    """``reward`` (PPO / REINFORCE++ only): subtract ``kl_coef * kl`` from the token rewards."""
    entropy_coef: float = 0.0
    epochs: int = 1
    mini_batch_size: int = 16
    """Trajectories per optimiser step."""
    mini_batches_by_group: bool = False
    """Mini-batches take whole groups (groups, and samples within each, in a seeded random order), so a
    group's shared prompt is forwarded once per mini-batch (0.6 of the tokens of a BabyAI step at
    mini-batch 8, group 8); False: trajectories shuffled across groups."""
    gamma: float = 1.0
    lam: float = 1.0
    normalize_by_std: bool = True
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    max_grad_norm: float = 1.0
    critic_learning_rate: float = 1e-5
    value_clip: float = 0.5
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8

    # --- rewards and data ----------------------------------------------------------------------
    outcome_reward: OutcomeReward = "score"
    """``score`` (env score normalised to [0, 1]: /100 for SciWorld, clipped), ``success`` (1/0), ``none``."""
    turn_reward_coef: float = 0.0
    """Weight of per-turn rewards (0: env step rewards already sum to the score; see rewards.py)."""
    invalid_action_penalty: float = 0.0
    """Subtracted (normalised units) for every malformed or rejected action (see ``rewards``)."""
    negative_advantage_scale: float = 1.0
    """Negative (outcome) advantages are multiplied by this, in [0, 1] (``advantages.scale_negative_advantages``)."""
    turn_validity_coef: float = 0.0
    """GRPO/RLOO: weight of the turn-level validity advantage added to the outcome advantage
    (``advantages.turn_validity_advantages``); 0 disables."""
    turn_validity_needs_success: bool = True
    """Validity credit only in groups where at least one sample succeeded (none elsewhere)."""
    step_group_coef: float = 0.0
    """GRPO/RLOO: weight of the step-level advantage over anchor states (GiGPO; turns of a group that
    acted from the same observation compared by discounted return, ``advantages.step_group_advantages``),
    added to the outcome advantage; 0 disables."""
    step_group_gamma: float = 0.95
    """Per-turn discount of the step-level returns (``advantages.turn_returns``)."""
    score_scales: dict[str, float] = field(default_factory=dict)
    """Overrides of the per-environment score unit (default sciworld 100, others 1)."""
    drop_uniform_groups: bool = False
    """GRPO/RLOO: leave out of the loss the groups whose samples all got the same outcome reward (all
    succeeded or all failed; DAPO's dynamic sampling): they carry no outcome advantage, only shaping
    credit (invalid-action penalty, turn validity, step groups), which goes with them. Counted per step
    (``uniform_groups``); ask for more tasks per step to make up for them."""
    train_on_failed: bool = False
    """Failed trajectories (TERMINATION_ERROR) are counted but excluded from the loss unless True."""
    recompute_old_logprobs: bool = False
    """False: the engine's sampled logprobs are the PPO ``old`` logprobs; True: recompute with the trainer's model."""

    # --- curriculum ----------------------------------------------------------------------------
    curriculum: dict[str, Any] = field(default_factory=lambda: {"kind": "fixed", "max_turns": 10})
    """``build_schedule`` arguments: ``{"kind": "fixed" | "scaling_inter" | "adaptive", ...}``."""

    # --- rollout (spec.rollout, spec.environments) ---------------------------------------------
    environments: list[EnvironmentConfig] = field(default_factory=lambda: [EnvironmentConfig("textcraft")])
    tasks_per_step: int = 8
    max_tokens_per_turn: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    max_staleness: int = 0
    """0: on-policy (only the current policy version is trained on); n > 0: up to n versions old."""

    # --- trainer (spec.trainer) ----------------------------------------------------------------
    backend: Literal["torch", "deepspeed"] = "torch"
    gpus: int = 0
    zero_stage: int = 2
    bf16: bool = False
    """bf16 mixed precision: DeepSpeed's bf16 on GPUs; autocast on a CPU with bf16 units (AVX512-BF16 or AMX),
    float32 on other CPUs (emulated bf16 is many times slower there; the trainer logs it)."""
    gradient_checkpointing: bool = False
    micro_batch_tokens: int = 8192
    """Packed tokens per forward row (one row per forward/backward, no padding)."""
    logits_chunk_tokens: int = 4096
    """Response positions per LM-head chunk (bounds the ``[tokens, vocab]`` logits)."""
    share_prompts: bool = True
    """Forward a prompt once for all the sequences that start with it (a group's samples); with sdpa /
    eager attention only (the flash and flex kernels pack by position ids and get separate copies)."""
    share_prompt_prefixes: bool = True
    """With ``share_prompts``: the different prompts packed in one row also share one copy of their common
    prefix (an environment's system prompt and instructions: 256 of BabyAI's ~380 prompt tokens)."""
    total_steps: int = 300
    checkpoint_every: int = 1
    keep_checkpoints: int = 3
    seed: int = 0
    sft_warmup_steps: int = 0
    sft_learning_rate: float = 1e-4
    """Learning rate of SFT warm-up / rejection-sampling fine-tuning (not in the spec)."""
    sft_batch_size: int = 8
    """Examples per SFT optimiser step."""
    sft_tasks: int = 32
    """Expert demonstrations per environment built for the SFT warm-up."""
    sft_thoughts: bool = True
    """Demonstrated replies carry a thought before the action (a generic one; the experts give actions
    only); off, the action line alone."""

    # --- data path and outputs -----------------------------------------------------------------
    collect_timeout_s: float = 600.0
    """Longest wait for a step's groups; then incomplete groups are used or dropped (collector docs)."""
    min_group_size: int = 2
    """An incomplete group is used at the timeout only with at least this many trajectories."""
    ack_wait_s: float = 60.0
    """JetStream ack wait of the trainer's consumer (held messages get in-progress heartbeats)."""
    recent_ids_capacity: int = 100_000
    """Trajectory ids remembered (and checkpointed) for deduplication."""
    tensorboard: bool = True
    otel_metrics: bool = True

    def __post_init__(self) -> None:
        self.output_dir = Path(self.output_dir)
        if self.algorithm not in ("grpo", "ppo", "rloo", "reinforce_plus_plus", "rft", "dpo"):
            raise ValueError(f"unknown algorithm {self.algorithm!r}")
        if self.dpo_beta <= 0:
            raise ValueError(f"dpo_beta must be > 0, got {self.dpo_beta}")
        if self.algorithm in ("grpo", "rloo", "dpo") and self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 for {self.algorithm}")
        if self.kl_as == "reward" and self.algorithm in ("grpo", "rloo"):
            raise ValueError("kl_as='reward' needs a token-level estimator (ppo, reinforce_plus_plus)")
        if not 0.0 <= self.negative_advantage_scale <= 1.0:
            raise ValueError(f"negative_advantage_scale must be in [0, 1], got {self.negative_advantage_scale}")
        if self.turn_validity_coef < 0:
            raise ValueError(f"turn_validity_coef must be >= 0, got {self.turn_validity_coef}")
        if self.turn_validity_coef and self.algorithm not in ("grpo", "rloo"):
            raise ValueError(
                "turn_validity_coef is for the group estimators (grpo, rloo); token-level estimators "
                "credit invalid turns through invalid_action_penalty"
            )
        if self.step_group_coef < 0:
            raise ValueError(f"step_group_coef must be >= 0, got {self.step_group_coef}")
        if not 0.0 <= self.step_group_gamma <= 1.0:
            raise ValueError(f"step_group_gamma must be in [0, 1], got {self.step_group_gamma}")
        if self.step_group_coef and self.algorithm not in ("grpo", "rloo"):
            raise ValueError(
                "step_group_coef is for the group estimators (grpo, rloo); token-level estimators "
                "already credit each turn by what follows it"
            )
        if self.drop_uniform_groups and self.algorithm not in ("grpo", "rloo"):
            raise ValueError("drop_uniform_groups is for the group estimators (grpo, rloo)")
        if self.drop_uniform_groups and self.outcome_reward == "none":
            raise ValueError(
                "drop_uniform_groups needs an outcome reward (outcome_reward 'none' makes every group uniform)"
            )
        for name in ("group_size", "epochs", "mini_batch_size", "tasks_per_step", "total_steps", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.keep_checkpoints < 1:
            raise ValueError("keep_checkpoints must be >= 1")
        if self.micro_batch_tokens < 1 or self.logits_chunk_tokens < 1:
            raise ValueError("micro_batch_tokens and logits_chunk_tokens must be >= 1")
        if self.max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")
        if not self.environments:
            raise ValueError("at least one environment is needed")
        if self.backend == "deepspeed" and self.gpus < 1:
            raise ValueError("backend deepspeed needs gpus >= 1")
        if self.backend == "torch" and self.gpus > 1:
            raise ValueError(f"backend torch trains on one device, not gpus={self.gpus}; use backend deepspeed")
        self.environments = [
            e if isinstance(e, EnvironmentConfig) else EnvironmentConfig(**e) for e in self.environments
        ]
        RewardConfig(
            self.outcome_reward, self.turn_reward_coef, self.score_scales, self.invalid_action_penalty
        )  # validates

    # ------------------------------------------------------------------------------------------

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir)

    @property
    def checkpoint_dir(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def weights_dir(self) -> Path:
        """Weights-only exports for steps that are not checkpointed (``checkpoint_every`` > 1)."""
        return self.run_dir / "weights"

    @property
    def uses_reference(self) -> bool:
        """Whether the update needs a frozen reference policy: the policy-gradient KL term, or DPO's anchor."""
        return self.algorithm == "dpo" or (self.kl_coef > 0 and self.algorithm != "rft")

    def reward_config(self) -> RewardConfig:
        return RewardConfig(self.outcome_reward, self.turn_reward_coef, self.score_scales, self.invalid_action_penalty)

    def build_schedule(self) -> HorizonSchedule:
        params = dict(self.curriculum)
        kind = str(params.pop("kind", "fixed"))
        return build_schedule(kind, **params)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Path):
                value = str(value)
            elif f.name == "environments":
                value = [
                    {"name": e.name, "split": e.split, "weight": e.weight, "url": e.url, "config": dict(e.config)}
                    for e in value
                ]
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_spec(
        cls, spec: Any, *, run: str = "local", output_dir: str | Path | None = None, **overrides: Any
    ) -> RLTrainerConfig:
        """The config of a ``TrainingRunSpec``; ``output_dir`` defaults to ``<storage.checkpointUri>/<run>``.

        The horizon schedule follows ``spec.curriculum`` with the FIRST environment's paper preset
        where a value is left unset (one horizon for the run: RolloutRequest.max_turns).
        """
        algo, roll, tr, cur = spec.algorithm, spec.rollout, spec.trainer, spec.curriculum
        first = spec.environments[0].name
        curriculum: dict[str, Any]
        if cur.kind == "fixed":
            curriculum = {"kind": "fixed", "max_turns": cur.max_turns or cur.horizon_stages(first)[-1]}
        elif cur.kind == "scaling_inter":
            curriculum = {
                "kind": "scaling_inter",
                "horizons": cur.horizon_stages(first),
                "stage_steps": cur.steps_per_stage(first),
            }
        else:
            adaptive = cur.adaptive
            curriculum = {
                "kind": "adaptive",
                "initial": adaptive.initial,
                "minimum": adaptive.minimum,
                "maximum": adaptive.maximum,
                "increment": adaptive.increment,
                "window": adaptive.window,
                "plateau_delta": adaptive.plateau_delta,
                "truncation_threshold": adaptive.truncation_threshold,
                "patience": adaptive.patience,
                "cooldown": adaptive.cooldown,
            }
        values: dict[str, Any] = {
            "model": spec.model.name,
            "tokenizer": spec.model.tokenizer,
            "output_dir": (
                Path(output_dir)
                if output_dir is not None
                else checkpoint_root_from_uri(spec.storage.checkpoint_uri) / run
            ),
            "run": run,
            "dtype": spec.model.dtype,
            "max_context_tokens": spec.model.max_context_tokens,
            "algorithm": algo.name,
            "group_size": algo.group_size,
            "learning_rate": algo.learning_rate,
            "clip_low": algo.clip_low,
            "clip_high": algo.clip_high,
            "kl_coef": algo.kl_coef,
            "dpo_beta": algo.dpo_beta,
            "kl_type": algo.kl_type,
            "kl_as": algo.kl_as,
            "entropy_coef": algo.entropy_coef,
            "epochs": algo.epochs,
            "mini_batch_size": algo.mini_batch_size,
            "gamma": algo.gamma,
            "lam": algo.lam,
            "normalize_by_std": algo.normalize_by_std,
            "loss_aggregation": algo.loss_aggregation,
            "invalid_action_penalty": algo.invalid_action_penalty,
            "turn_validity_coef": algo.turn_validity_coef,
            "turn_validity_needs_success": algo.turn_validity_needs_success,
            "step_group_coef": algo.step_group_coef,
            "step_group_gamma": algo.step_group_gamma,
            "negative_advantage_scale": algo.negative_advantage_scale,
            "drop_uniform_groups": algo.drop_uniform_groups,
            "max_grad_norm": algo.max_grad_norm,
            "critic_learning_rate": algo.critic_learning_rate,
            "value_clip": algo.value_clip,
            "curriculum": curriculum,
            "environments": [
                EnvironmentConfig(e.name, e.split, e.weight, e.url, dict(e.config)) for e in spec.environments
            ],
            "tasks_per_step": roll.tasks_per_step,
            "max_tokens_per_turn": roll.max_tokens_per_turn,
            "temperature": roll.temperature,
            "top_p": roll.top_p,
            "max_staleness": roll.max_staleness,
            "backend": tr.backend,
            "gpus": tr.gpus,
            "zero_stage": tr.zero_stage,
            "bf16": tr.bf16,
            "gradient_checkpointing": tr.gradient_checkpointing,
            "micro_batch_tokens": tr.micro_batch_tokens,
            "total_steps": tr.total_steps,
            "checkpoint_every": tr.checkpoint_every,
            "keep_checkpoints": tr.keep_checkpoints,
            "seed": tr.seed,
            "sft_warmup_steps": tr.sft_warmup_steps,
            "sft_learning_rate": tr.sft_learning_rate,
            "sft_tasks": tr.sft_tasks,
            "sft_batch_size": tr.sft_batch_size,
            "sft_thoughts": tr.sft_thoughts,
        }
        values.update(overrides)
        return cls(**values)
