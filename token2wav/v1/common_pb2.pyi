from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_INT16: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_INT32: DType
DTYPE_INT64: DType
DTYPE_INT16: DType

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Voice(_message.Message):
    __slots__ = ("prompt_token", "prompt_feat", "embedding")
    PROMPT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FEAT_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    prompt_token: Tensor
    prompt_feat: Tensor
    embedding: Tensor
    def __init__(self, prompt_token: _Optional[_Union[Tensor, _Mapping]] = ..., prompt_feat: _Optional[_Union[Tensor, _Mapping]] = ..., embedding: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class StageTiming(_message.Message):
    __slots__ = ("queue_ms", "compute_ms", "batch_size")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    compute_ms: float
    batch_size: int
    def __init__(self, queue_ms: _Optional[float] = ..., compute_ms: _Optional[float] = ..., batch_size: _Optional[int] = ...) -> None: ...
