from token2wav.v1 import common_pb2 as _common_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VocoderChunk(_message.Message):
    __slots__ = ("request_id", "seq", "mel", "finalize", "slack_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    MEL_FIELD_NUMBER: _ClassVar[int]
    FINALIZE_FIELD_NUMBER: _ClassVar[int]
    SLACK_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    seq: int
    mel: _common_pb2.Tensor
    finalize: bool
    slack_ms: int
    def __init__(self, request_id: _Optional[str] = ..., seq: _Optional[int] = ..., mel: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., finalize: _Optional[bool] = ..., slack_ms: _Optional[int] = ...) -> None: ...

class VocoderAudio(_message.Message):
    __slots__ = ("request_id", "seq", "sample_offset", "audio", "is_final", "timing")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    IS_FINAL_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    seq: int
    sample_offset: int
    audio: _common_pb2.Tensor
    is_final: bool
    timing: _common_pb2.StageTiming
    def __init__(self, request_id: _Optional[str] = ..., seq: _Optional[int] = ..., sample_offset: _Optional[int] = ..., audio: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., is_final: _Optional[bool] = ..., timing: _Optional[_Union[_common_pb2.StageTiming, _Mapping]] = ...) -> None: ...

class CancelSessionRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelSessionResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: _Optional[bool] = ...) -> None: ...

class ExportSessionRequest(_message.Message):
    __slots__ = ("request_id", "remove")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REMOVE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    remove: bool
    def __init__(self, request_id: _Optional[str] = ..., remove: _Optional[bool] = ...) -> None: ...

class ExportSessionResponse(_message.Message):
    __slots__ = ("state", "next_seq", "sample_offset")
    STATE_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    state: bytes
    next_seq: int
    sample_offset: int
    def __init__(self, state: _Optional[bytes] = ..., next_seq: _Optional[int] = ..., sample_offset: _Optional[int] = ...) -> None: ...

class ImportSessionRequest(_message.Message):
    __slots__ = ("request_id", "state", "next_seq")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    state: bytes
    next_seq: int
    def __init__(self, request_id: _Optional[str] = ..., state: _Optional[bytes] = ..., next_seq: _Optional[int] = ...) -> None: ...

class ImportSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
