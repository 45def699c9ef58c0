from token2wav.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AudioFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AUDIO_FORMAT_UNSPECIFIED: _ClassVar[AudioFormat]
    AUDIO_FORMAT_PCM16: _ClassVar[AudioFormat]
    AUDIO_FORMAT_FLOAT32: _ClassVar[AudioFormat]
    AUDIO_FORMAT_MULAW: _ClassVar[AudioFormat]
    AUDIO_FORMAT_ALAW: _ClassVar[AudioFormat]
    AUDIO_FORMAT_OPUS_OGG: _ClassVar[AudioFormat]
    AUDIO_FORMAT_OPUS_PACKETS: _ClassVar[AudioFormat]
    AUDIO_FORMAT_WAV: _ClassVar[AudioFormat]
    AUDIO_FORMAT_MP3: _ClassVar[AudioFormat]

class ScheduleKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCHEDULE_KIND_UNSPECIFIED: _ClassVar[ScheduleKind]
    SCHEDULE_KIND_UPSTREAM: _ClassVar[ScheduleKind]
    SCHEDULE_KIND_BLOCKS: _ClassVar[ScheduleKind]

class FinalAttention(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINAL_ATTENTION_UNSPECIFIED: _ClassVar[FinalAttention]
    FINAL_ATTENTION_FULL: _ClassVar[FinalAttention]
    FINAL_ATTENTION_CHUNKED: _ClassVar[FinalAttention]
AUDIO_FORMAT_UNSPECIFIED: AudioFormat
AUDIO_FORMAT_PCM16: AudioFormat
AUDIO_FORMAT_FLOAT32: AudioFormat
AUDIO_FORMAT_MULAW: AudioFormat
AUDIO_FORMAT_ALAW: AudioFormat
AUDIO_FORMAT_OPUS_OGG: AudioFormat
AUDIO_FORMAT_OPUS_PACKETS: AudioFormat
AUDIO_FORMAT_WAV: AudioFormat
AUDIO_FORMAT_MP3: AudioFormat
SCHEDULE_KIND_UNSPECIFIED: ScheduleKind
SCHEDULE_KIND_UPSTREAM: ScheduleKind
SCHEDULE_KIND_BLOCKS: ScheduleKind
FINAL_ATTENTION_UNSPECIFIED: FinalAttention
FINAL_ATTENTION_FULL: FinalAttention
FINAL_ATTENTION_CHUNKED: FinalAttention

class SynthesizeRequest(_message.Message):
    __slots__ = ("config", "tokens", "end")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    config: StreamConfig
    tokens: TokenChunk
    end: EndOfInput
    def __init__(self, config: _Optional[_Union[StreamConfig, _Mapping]] = ..., tokens: _Optional[_Union[TokenChunk, _Mapping]] = ..., end: _Optional[_Union[EndOfInput, _Mapping]] = ...) -> None: ...

class StreamConfig(_message.Message):
    __slots__ = ("request_id", "inline_voice", "voice_id", "audio_format", "schedule", "sample_rate", "resume_from_sample", "start_buffer_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INLINE_VOICE_FIELD_NUMBER: _ClassVar[int]
    VOICE_ID_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FORMAT_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    START_BUFFER_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    inline_voice: _common_pb2.Voice
    voice_id: str
    audio_format: AudioFormat
    schedule: ChunkSchedule
    sample_rate: int
    resume_from_sample: int
    start_buffer_ms: int
    def __init__(self, request_id: _Optional[str] = ..., inline_voice: _Optional[_Union[_common_pb2.Voice, _Mapping]] = ..., voice_id: _Optional[str] = ..., audio_format: _Optional[_Union[AudioFormat, str]] = ..., schedule: _Optional[_Union[ChunkSchedule, _Mapping]] = ..., sample_rate: _Optional[int] = ..., resume_from_sample: _Optional[int] = ..., start_buffer_ms: _Optional[int] = ...) -> None: ...

class ChunkSchedule(_message.Message):
    __slots__ = ("first_hop_tokens", "max_hop_tokens", "hop_scale", "disable_prompt_pad", "kind", "final_attention")
    FIRST_HOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_HOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HOP_SCALE_FIELD_NUMBER: _ClassVar[int]
    DISABLE_PROMPT_PAD_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    FINAL_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    first_hop_tokens: int
    max_hop_tokens: int
    hop_scale: int
    disable_prompt_pad: bool
    kind: ScheduleKind
    final_attention: FinalAttention
    def __init__(self, first_hop_tokens: _Optional[int] = ..., max_hop_tokens: _Optional[int] = ..., hop_scale: _Optional[int] = ..., disable_prompt_pad: _Optional[bool] = ..., kind: _Optional[_Union[ScheduleKind, str]] = ..., final_attention: _Optional[_Union[FinalAttention, str]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class EndOfInput(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ChunkTiming(_message.Message):
    __slots__ = ("flow_queue_ms", "flow_compute_ms", "flow_batch_size", "vocoder_queue_ms", "vocoder_compute_ms", "vocoder_batch_size", "gateway_ms")
    FLOW_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    FLOW_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    FLOW_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCODER_QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    VOCODER_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    VOCODER_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_MS_FIELD_NUMBER: _ClassVar[int]
    flow_queue_ms: float
    flow_compute_ms: float
    flow_batch_size: int
    vocoder_queue_ms: float
    vocoder_compute_ms: float
    vocoder_batch_size: int
    gateway_ms: float
    def __init__(self, flow_queue_ms: _Optional[float] = ..., flow_compute_ms: _Optional[float] = ..., flow_batch_size: _Optional[int] = ..., vocoder_queue_ms: _Optional[float] = ..., vocoder_compute_ms: _Optional[float] = ..., vocoder_batch_size: _Optional[int] = ..., gateway_ms: _Optional[float] = ...) -> None: ...

class SynthesizeResponse(_message.Message):
    __slots__ = ("request_id", "seq", "sample_offset", "sample_rate", "audio_format", "audio", "num_samples", "is_final", "timing")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FORMAT_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    IS_FINAL_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    seq: int
    sample_offset: int
    sample_rate: int
    audio_format: AudioFormat
    audio: bytes
    num_samples: int
    is_final: bool
    timing: ChunkTiming
    def __init__(self, request_id: _Optional[str] = ..., seq: _Optional[int] = ..., sample_offset: _Optional[int] = ..., sample_rate: _Optional[int] = ..., audio_format: _Optional[_Union[AudioFormat, str]] = ..., audio: _Optional[bytes] = ..., num_samples: _Optional[int] = ..., is_final: _Optional[bool] = ..., timing: _Optional[_Union[ChunkTiming, _Mapping]] = ...) -> None: ...

class RegisterVoiceRequest(_message.Message):
    __slots__ = ("voice", "audio_file", "audio_pcm")
    VOICE_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FILE_FIELD_NUMBER: _ClassVar[int]
    AUDIO_PCM_FIELD_NUMBER: _ClassVar[int]
    voice: _common_pb2.Voice
    audio_file: bytes
    audio_pcm: PcmAudio
    def __init__(self, voice: _Optional[_Union[_common_pb2.Voice, _Mapping]] = ..., audio_file: _Optional[bytes] = ..., audio_pcm: _Optional[_Union[PcmAudio, _Mapping]] = ...) -> None: ...

class PcmAudio(_message.Message):
    __slots__ = ("samples", "sample_rate")
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    samples: _common_pb2.Tensor
    sample_rate: int
    def __init__(self, samples: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., sample_rate: _Optional[int] = ...) -> None: ...

class RegisterVoiceResponse(_message.Message):
    __slots__ = ("voice_id", "created", "prompt_token", "voice")
    VOICE_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    VOICE_FIELD_NUMBER: _ClassVar[int]
    voice_id: str
    created: bool
    prompt_token: _common_pb2.Tensor
    voice: _common_pb2.Voice
    def __init__(self, voice_id: _Optional[str] = ..., created: _Optional[bool] = ..., prompt_token: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., voice: _Optional[_Union[_common_pb2.Voice, _Mapping]] = ...) -> None: ...

class DeleteVoiceRequest(_message.Message):
    __slots__ = ("voice_id",)
    VOICE_ID_FIELD_NUMBER: _ClassVar[int]
    voice_id: str
    def __init__(self, voice_id: _Optional[str] = ...) -> None: ...

class DeleteVoiceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
