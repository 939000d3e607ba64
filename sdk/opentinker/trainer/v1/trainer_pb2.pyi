from opentinker.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetTrainerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTrainerStatusResponse(_message.Message):
    __slots__ = ("job_id", "step", "policy_version", "finetune", "trainable_parameters", "last_metrics")
    class LastMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    FINETUNE_FIELD_NUMBER: _ClassVar[int]
    TRAINABLE_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    LAST_METRICS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    step: int
    policy_version: int
    finetune: _common_pb2.FinetuneMode
    trainable_parameters: int
    last_metrics: _containers.ScalarMap[str, float]
    def __init__(self, job_id: _Optional[str] = ..., step: _Optional[int] = ..., policy_version: _Optional[int] = ..., finetune: _Optional[_Union[_common_pb2.FinetuneMode, str]] = ..., trainable_parameters: _Optional[int] = ..., last_metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...
