from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Termination(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TERMINATION_UNSPECIFIED: _ClassVar[Termination]
    TERMINATION_DONE: _ClassVar[Termination]
    TERMINATION_HORIZON: _ClassVar[Termination]
    TERMINATION_ERROR: _ClassVar[Termination]
    TERMINATION_CONTEXT_LIMIT: _ClassVar[Termination]
TERMINATION_UNSPECIFIED: Termination
TERMINATION_DONE: Termination
TERMINATION_HORIZON: Termination
TERMINATION_ERROR: Termination
TERMINATION_CONTEXT_LIMIT: Termination

class RolloutRequest(_message.Message):
    __slots__ = ("run", "request_id", "step", "environment", "task_id", "group_id", "sample_index", "group_size", "max_turns", "policy_version", "max_tokens_per_turn", "temperature", "top_p", "seed")
    RUN_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_TURN_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    run: str
    request_id: str
    step: int
    environment: str
    task_id: str
    group_id: str
    sample_index: int
    group_size: int
    max_turns: int
    policy_version: int
    max_tokens_per_turn: int
    temperature: float
    top_p: float
    seed: int
    def __init__(self, run: _Optional[str] = ..., request_id: _Optional[str] = ..., step: _Optional[int] = ..., environment: _Optional[str] = ..., task_id: _Optional[str] = ..., group_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., group_size: _Optional[int] = ..., max_turns: _Optional[int] = ..., policy_version: _Optional[int] = ..., max_tokens_per_turn: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class Turn(_message.Message):
    __slots__ = ("action_start", "action_end", "observation_end", "action", "reward", "done", "invalid_action", "repeated_action", "inference_seconds", "env_seconds")
    ACTION_START_FIELD_NUMBER: _ClassVar[int]
    ACTION_END_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_END_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    INVALID_ACTION_FIELD_NUMBER: _ClassVar[int]
    REPEATED_ACTION_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENV_SECONDS_FIELD_NUMBER: _ClassVar[int]
    action_start: int
    action_end: int
    observation_end: int
    action: str
    reward: float
    done: bool
    invalid_action: bool
    repeated_action: bool
    inference_seconds: float
    env_seconds: float
    def __init__(self, action_start: _Optional[int] = ..., action_end: _Optional[int] = ..., observation_end: _Optional[int] = ..., action: _Optional[str] = ..., reward: _Optional[float] = ..., done: _Optional[bool] = ..., invalid_action: _Optional[bool] = ..., repeated_action: _Optional[bool] = ..., inference_seconds: _Optional[float] = ..., env_seconds: _Optional[float] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("started_at", "finished_at", "inference_seconds", "env_seconds")
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENV_SECONDS_FIELD_NUMBER: _ClassVar[int]
    started_at: float
    finished_at: float
    inference_seconds: float
    env_seconds: float
    def __init__(self, started_at: _Optional[float] = ..., finished_at: _Optional[float] = ..., inference_seconds: _Optional[float] = ..., env_seconds: _Optional[float] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("run", "trajectory_id", "request_id", "step", "group_id", "sample_index", "task_id", "environment", "policy_version", "horizon", "prompt_token_ids", "response_token_ids", "loss_mask", "sampled_logprobs", "turns", "final_score", "success", "turns_used", "termination", "termination_reason", "timings")
    RUN_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    HORIZON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    FINAL_SCORE_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    TURNS_USED_FIELD_NUMBER: _ClassVar[int]
    TERMINATION_FIELD_NUMBER: _ClassVar[int]
    TERMINATION_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    run: str
    trajectory_id: str
    request_id: str
    step: int
    group_id: str
    sample_index: int
    task_id: str
    environment: str
    policy_version: int
    horizon: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    response_token_ids: _containers.RepeatedScalarFieldContainer[int]
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    sampled_logprobs: _containers.RepeatedScalarFieldContainer[float]
    turns: _containers.RepeatedCompositeFieldContainer[Turn]
    final_score: float
    success: bool
    turns_used: int
    termination: Termination
    termination_reason: str
    timings: Timings
    def __init__(self, run: _Optional[str] = ..., trajectory_id: _Optional[str] = ..., request_id: _Optional[str] = ..., step: _Optional[int] = ..., group_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., task_id: _Optional[str] = ..., environment: _Optional[str] = ..., policy_version: _Optional[int] = ..., horizon: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., response_token_ids: _Optional[_Iterable[int]] = ..., loss_mask: _Optional[_Iterable[int]] = ..., sampled_logprobs: _Optional[_Iterable[float]] = ..., turns: _Optional[_Iterable[_Union[Turn, _Mapping]]] = ..., final_score: _Optional[float] = ..., success: _Optional[bool] = ..., turns_used: _Optional[int] = ..., termination: _Optional[_Union[Termination, str]] = ..., termination_reason: _Optional[str] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ...) -> None: ...

class WeightUpdate(_message.Message):
    __slots__ = ("run", "version", "uri", "step", "format", "created_at")
    RUN_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    run: str
    version: int
    uri: str
    step: int
    format: str
    created_at: float
    def __init__(self, run: _Optional[str] = ..., version: _Optional[int] = ..., uri: _Optional[str] = ..., step: _Optional[int] = ..., format: _Optional[str] = ..., created_at: _Optional[float] = ...) -> None: ...

class CurriculumState(_message.Message):
    __slots__ = ("run", "step", "stage", "horizon", "schedule", "updated_at", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    HORIZON_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    run: str
    step: int
    stage: int
    horizon: int
    schedule: str
    updated_at: float
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, run: _Optional[str] = ..., step: _Optional[int] = ..., stage: _Optional[int] = ..., horizon: _Optional[int] = ..., schedule: _Optional[str] = ..., updated_at: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...
