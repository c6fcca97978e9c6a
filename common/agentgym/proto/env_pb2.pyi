from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SplitIndex(_message.Message):
    __slots__ = ("split", "index")
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    split: str
    index: int
    def __init__(self, split: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class TaskSelector(_message.Message):
    __slots__ = ("task_id", "split_index")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SPLIT_INDEX_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    split_index: SplitIndex
    def __init__(self, task_id: _Optional[str] = ..., split_index: _Optional[_Union[SplitIndex, _Mapping]] = ...) -> None: ...

class CreateEpisodeRequest(_message.Message):
    __slots__ = ("task",)
    TASK_FIELD_NUMBER: _ClassVar[int]
    task: TaskSelector
    def __init__(self, task: _Optional[_Union[TaskSelector, _Mapping]] = ...) -> None: ...

class ResetEpisodeRequest(_message.Message):
    __slots__ = ("episode_id", "task")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    task: TaskSelector
    def __init__(self, episode_id: _Optional[str] = ..., task: _Optional[_Union[TaskSelector, _Mapping]] = ...) -> None: ...

class EpisodeRef(_message.Message):
    __slots__ = ("episode_id",)
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    def __init__(self, episode_id: _Optional[str] = ...) -> None: ...

class EpisodeReply(_message.Message):
    __slots__ = ("episode_id", "task_id", "observation", "available_actions", "has_available_actions", "info")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_ACTIONS_FIELD_NUMBER: _ClassVar[int]
    HAS_AVAILABLE_ACTIONS_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    task_id: str
    observation: str
    available_actions: _containers.RepeatedScalarFieldContainer[str]
    has_available_actions: bool
    info: _struct_pb2.Struct
    def __init__(self, episode_id: _Optional[str] = ..., task_id: _Optional[str] = ..., observation: _Optional[str] = ..., available_actions: _Optional[_Iterable[str]] = ..., has_available_actions: _Optional[bool] = ..., info: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("episode_id", "action")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    action: str
    def __init__(self, episode_id: _Optional[str] = ..., action: _Optional[str] = ...) -> None: ...

class StepReply(_message.Message):
    __slots__ = ("observation", "reward", "score", "done", "truncated", "available_actions", "has_available_actions", "info")
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    AVAILABLE_ACTIONS_FIELD_NUMBER: _ClassVar[int]
    HAS_AVAILABLE_ACTIONS_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    observation: str
    reward: float
    score: float
    done: bool
    truncated: bool
    available_actions: _containers.RepeatedScalarFieldContainer[str]
    has_available_actions: bool
    info: _struct_pb2.Struct
    def __init__(self, observation: _Optional[str] = ..., reward: _Optional[float] = ..., score: _Optional[float] = ..., done: _Optional[bool] = ..., truncated: _Optional[bool] = ..., available_actions: _Optional[_Iterable[str]] = ..., has_available_actions: _Optional[bool] = ..., info: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class ObserveReply(_message.Message):
    __slots__ = ("episode_id", "task_id", "observation", "status", "steps", "score")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    episode_id: str
    task_id: str
    observation: str
    status: str
    steps: int
    score: float
    def __init__(self, episode_id: _Optional[str] = ..., task_id: _Optional[str] = ..., observation: _Optional[str] = ..., status: _Optional[str] = ..., steps: _Optional[int] = ..., score: _Optional[float] = ...) -> None: ...

class CloseReply(_message.Message):
    __slots__ = ("closed",)
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    closed: bool
    def __init__(self, closed: _Optional[bool] = ...) -> None: ...

class ListTasksRequest(_message.Message):
    __slots__ = ("split", "offset", "limit")
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    split: str
    offset: int
    limit: int
    def __init__(self, split: _Optional[str] = ..., offset: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class ListTasksReply(_message.Message):
    __slots__ = ("splits", "task_ids")
    class SplitsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    SPLITS_FIELD_NUMBER: _ClassVar[int]
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    splits: _containers.ScalarMap[str, int]
    task_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, splits: _Optional[_Mapping[str, int]] = ..., task_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("status", "environment", "live_episodes", "max_episodes")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    LIVE_EPISODES_FIELD_NUMBER: _ClassVar[int]
    MAX_EPISODES_FIELD_NUMBER: _ClassVar[int]
    status: str
    environment: str
    live_episodes: int
    max_episodes: int
    def __init__(self, status: _Optional[str] = ..., environment: _Optional[str] = ..., live_episodes: _Optional[int] = ..., max_episodes: _Optional[int] = ...) -> None: ...
