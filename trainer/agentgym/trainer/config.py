"""``RLTrainerConfig``: everything the trainer needs, built from a ``TrainingRunSpec`` or by hand.

    config = RLTrainerConfig.from_spec(run.spec, run=run.metadata.name)
    config = RLTrainerConfig(model="builtin:tiny", output_dir="runs/demo", algorithm="grpo", group_size=4)

Fields mirror the spec (``model.*``, ``algorithm.*``, ``rollout.*``, ``trainer.*``, ``curriculum``; copied
by name in :meth:`RLTrainerConfig.from_spec`) plus trainer options the spec does not carry (reward
convention, old-logprob recomputation, SFT settings, collector timeouts); their defaults are documented
on each field. The mirrored fields are validated by the spec's own rules (its field bounds and
``agentgym.spec.algorithm_rule_error`` / ``backend_rule_error``), so a config built by hand obeys the
same rules as one built from a spec; only the trainer's own knobs have rules here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel

from agentgym.spec import TrainingRunSpec, algorithm_rule_error, backend_rule_error
from agentgym.trainer.curriculum import HorizonSchedule, ScalingInterSchedule, build_schedule
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
    horizons: list[int] = field(default_factory=list)
    """Its horizon per ScalingInter stage (the run's stages); empty: the schedule's horizon, as every environment."""


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
    lr_warmup_steps: int = 0
    """RL steps over which the policy's learning rate rises linearly to ``learning_rate`` (``learning_rate_at``)."""
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
        # The rules of the fields the spec has are the spec's: its field bounds and its cross-field rules.
        for section, rename in _SPEC_SECTIONS:
            _check_spec_bounds(self, section, rename)
        problem = algorithm_rule_error(
            self.algorithm,
            group_size=self.group_size,
            kl_as=self.kl_as,
            turn_validity_coef=self.turn_validity_coef,
            step_group_coef=self.step_group_coef,
            drop_uniform_groups=self.drop_uniform_groups,
            field=str,
            group_estimators="the group estimators (grpo, rloo)",
        ) or backend_rule_error(self.backend, self.gpus)
        if problem:
            raise ValueError(problem)
        # The rest is about knobs the spec does not have.
        if self.drop_uniform_groups and self.outcome_reward == "none":
            raise ValueError(
                "drop_uniform_groups needs an outcome reward (outcome_reward 'none' makes every group uniform)"
            )
        if self.micro_batch_tokens < 1 or self.logits_chunk_tokens < 1:
            raise ValueError("micro_batch_tokens and logits_chunk_tokens must be >= 1")
        if not self.environments:
            raise ValueError("at least one environment is needed")
        self.environments = [
            e if isinstance(e, EnvironmentConfig) else EnvironmentConfig(**e) for e in self.environments
        ]
        staged = [e for e in self.environments if e.horizons]
        if staged:
            stages = self.build_schedule()
            if not isinstance(stages, ScalingInterSchedule):
                raise ValueError("environment horizons need a scaling_inter curriculum (they follow its stages)")
            for e in staged:
                if len(e.horizons) != len(stages.horizons):
                    raise ValueError(
                        f"environment {e.name}: {len(e.horizons)} horizons for {len(stages.horizons)} curriculum stages"
                    )
        self.reward_config()  # validates the reward knobs

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

    def learning_rate_at(self, step: int) -> float:
        """The policy's learning rate for RL step ``step`` (0-based), a linear warm-up over W = ``lr_warmup_steps``:

            lr_s = learning_rate * min(1, (s + 1) / W)        (W = 0: learning_rate from the first step)

        RL starts with a fresh AdamW (after the SFT warm-up too), whose first updates have magnitude ~lr in every
        parameter whatever the gradient's scale (m / sqrt(v) ~ sign(g) until v averages several gradients); the
        warm-up keeps those first moves small. The critic keeps ``critic_learning_rate``."""
        if self.lr_warmup_steps <= 0:
            return self.learning_rate
        return self.learning_rate * min(1.0, (step + 1) / self.lr_warmup_steps)

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

        Every field of ``spec.model``, ``spec.algorithm``, ``spec.rollout`` and ``spec.trainer`` that the
        config has is copied (``model.name`` is ``model``, ``algorithm.name`` is ``algorithm``). The horizon
        schedule follows ``spec.curriculum`` with the FIRST environment's horizons (its own, the curriculum's or the
        paper's) and stage length; with scaling_inter each environment keeps its own horizon per stage
        (``EnvironmentConfig.horizons``: a RolloutRequest's max_turns is its environment's).
        """
        sections = [(spec.model, {"name": "model"})] + [(getattr(spec, s), r) for s, r in _SPEC_SECTIONS]
        values: dict[str, Any] = {}
        for section, rename in sections:
            values.update(_shared_fields(section, rename))
        values["run"] = run
        values["output_dir"] = (
            Path(output_dir) if output_dir is not None else checkpoint_root_from_uri(spec.storage.checkpoint_uri) / run
        )
        values["curriculum"] = _curriculum(spec)
        staged = spec.curriculum.kind == "scaling_inter"
        values["environments"] = [
            EnvironmentConfig(
                e.name, e.split, e.weight, e.url, dict(e.config), spec.horizon_stages(e.name) if staged else []
            )
            for e in spec.environments
        ]
        values.update(overrides)
        return cls(**values)


# Spec sections whose fields the config mirrors (by name; renamed where the config's name differs).
_SPEC_SECTIONS: tuple[tuple[str, dict[str, str]], ...] = (
    ("algorithm", {"name": "algorithm"}),
    ("rollout", {}),
    ("trainer", {}),
)
# A config built by hand may go below the spec's minimum here: the trainer packs rows of any size (tests
# use small ones); a run's spec asks for >= 128.
_WIDER_THAN_SPEC = frozenset({"micro_batch_tokens"})


def _config_fields() -> set[str]:
    return {f.name for f in fields(RLTrainerConfig)}


def _shared_fields(section: BaseModel, rename: dict[str, str]) -> dict[str, Any]:
    """``section``'s values of the fields the config has, under the config's names."""
    names = _config_fields()
    out = {}
    for spec_name in type(section).model_fields:
        name = rename.get(spec_name, spec_name)
        if name in names:
            out[name] = getattr(section, spec_name)
    return out


def _check_spec_bounds(config: RLTrainerConfig, section: str, rename: dict[str, str]) -> None:
    """The spec's bounds (``Field(ge=..., le=...)``) on the config's copies of ``section``'s fields."""
    model = TrainingRunSpec.model_fields[section].annotation
    assert isinstance(model, type) and issubclass(model, BaseModel)
    names = _config_fields()
    for spec_name, info in model.model_fields.items():
        name = rename.get(spec_name, spec_name)
        if name not in names or name in _WIDER_THAN_SPEC:
            continue
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        lower, upper = _bounds(info.metadata)
        if _holds(value, lower) and _holds(value, upper):
            continue
        if lower and upper:
            left, right = "[" if lower[0] == ">=" else "(", "]" if upper[0] == "<=" else ")"
            raise ValueError(f"{name} must be in {left}{lower[1]}, {upper[1]}{right}, got {value}")
        op, bound = lower or upper or ("", 0)
        raise ValueError(f"{name} must be {op} {bound}, got {value}")


Bound = tuple[str, float]


def _bounds(metadata: list[Any]) -> tuple[Bound | None, Bound | None]:
    """The (operator, limit) of a pydantic field's lower and upper bound, each None when it has none."""
    lower: Bound | None = None
    upper: Bound | None = None
    for m in metadata:
        if isinstance(m, Ge):
            lower = (">=", float(m.ge))  # type: ignore[arg-type]
        elif isinstance(m, Gt):
            lower = (">", float(m.gt))  # type: ignore[arg-type]
        elif isinstance(m, Le):
            upper = ("<=", float(m.le))  # type: ignore[arg-type]
        elif isinstance(m, Lt):
            upper = ("<", float(m.lt))  # type: ignore[arg-type]
    return lower, upper


def _holds(value: float, bound: Bound | None) -> bool:
    if bound is None:
        return True
    op, limit = bound
    return {">=": value >= limit, ">": value > limit, "<=": value <= limit, "<": value < limit}[op]


def _curriculum(spec: Any) -> dict[str, Any]:
    """``build_schedule`` arguments of a run's ``curriculum``, with its first environment's horizons where unset."""
    cur, first = spec.curriculum, spec.environments[0].name
    if cur.kind == "fixed":
        return {"kind": "fixed", "max_turns": cur.max_turns or spec.horizon_stages(first)[-1]}
    if cur.kind == "scaling_inter":
        return {
            "kind": "scaling_inter",
            "horizons": spec.horizon_stages(first),
            "stage_steps": cur.steps_per_stage(first),
        }
    return {"kind": "adaptive", **cur.adaptive.model_dump()}
