from token2wav.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "seq", "inline_voice", "voice_id", "tokens", "token_offset", "finalize", "streaming", "slack_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    INLINE_VOICE_FIELD_NUMBER: _ClassVar[int]
    VOICE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_OFFSET_FIELD_NUMBER: _ClassVar[int]
    FINALIZE_FIELD_NUMBER: _ClassVar[int]
    STREAMING_FIELD_NUMBER: _ClassVar[int]
    SLACK_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    seq: int
    inline_voice: _common_pb2.Voice
    voice_id: str
    tokens: _common_pb2.Tensor
    token_offset: int
    finalize: bool
    streaming: bool
    slack_ms: int
    def __init__(self, request_id: _Optional[str] = ..., seq: _Optional[int] = ..., inline_voice: _Optional[_Union[_common_pb2.Voice, _Mapping]] = ..., voice_id: _Optional[str] = ..., tokens: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., token_offset: _Optional[int] = ..., finalize: _Optional[bool] = ..., streaming: _Optional[bool] = ..., slack_ms: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("mel", "voice_id", "timing", "padded_frames", "capacity_frames_per_s")
    MEL_FIELD_NUMBER: _ClassVar[int]
    VOICE_ID_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    PADDED_FRAMES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FRAMES_PER_S_FIELD_NUMBER: _ClassVar[int]
    mel: _common_pb2.Tensor
    voice_id: str
    timing: _common_pb2.StageTiming
    padded_frames: int
    capacity_frames_per_s: float
    def __init__(self, mel: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., voice_id: _Optional[str] = ..., timing: _Optional[_Union[_common_pb2.StageTiming, _Mapping]] = ..., padded_frames: _Optional[int] = ..., capacity_frames_per_s: _Optional[float] = ...) -> None: ...
