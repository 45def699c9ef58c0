"""Wire codecs: numpy/torch arrays <-> `token2wav.v1.Tensor` (raw little-endian bytes + dtype +
shape), and the validated voice that every service receives.

Decoding never trusts the sender: byte length must equal prod(shape) x itemsize, the dtype must
be one the field allows, rank and fixed dimensions must match, float values must be finite where
the field demands it, and sizes are capped. Every failure raises `InvalidArgument` naming the
field, so the servicer can answer INVALID_ARGUMENT with a useful message.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from token2wav import MAX_PROMPT_TOKENS, MEL_BINS, SPK_EMBED_DIM, TOKEN_MEL_RATIO, VOCAB_SIZE
from token2wav.errors import InvalidArgument
from token2wav.v1 import common_pb2 as pb

MAX_TENSOR_BYTES = 64 << 20  # larger than any legal field (300 s of mel is 4.8 MB)

# wire dtype -> numpy dtype (explicitly little-endian)
WIRE_DTYPES: dict[int, np.dtype] = {
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_INT32: np.dtype("<i4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_INT16: np.dtype("<i2"),
}
_NUMPY_TO_WIRE = {np.dtype(v).newbyteorder("="): k for k, v in WIRE_DTYPES.items()}
FLOAT_DTYPES = (pb.DTYPE_FLOAT32,)
INT_DTYPES = (pb.DTYPE_INT32, pb.DTYPE_INT64)


def encode(array: np.ndarray | torch.Tensor) -> pb.Tensor:
    """Encode a CPU array; float64 is narrowed to float32, bool and other types are refused."""
    if isinstance(array, torch.Tensor):
        array = array.detach().to("cpu")
        if array.dtype in (torch.float64, torch.bfloat16, torch.float16):
            array = array.float()
        array = array.numpy()
    array = np.asarray(array)
    if array.dtype == np.float64:
        array = array.astype(np.float32)
    wire = _NUMPY_TO_WIRE.get(array.dtype.newbyteorder("="))
    if wire is None:
        raise TypeError(f"dtype {array.dtype} has no wire encoding")
    data = np.ascontiguousarray(array, dtype=WIRE_DTYPES[wire]).tobytes()
    return pb.Tensor(dtype=wire, shape=list(array.shape), data=data)


def check_header(
    msg: pb.Tensor,
    field: str,
    *,
    dtypes: Sequence[int] = FLOAT_DTYPES,
    shape: Sequence[int | None] | None = None,
    max_bytes: int = MAX_TENSOR_BYTES,
    required: bool = True,
) -> list[int]:
    """Validate one tensor field's dtype, shape and byte count without touching its values;
    returns its shape. For a tensor that is forwarded as it came (the gateway's mel)."""
    return _checked(msg, field, dtypes, shape, max_bytes, required)[0]


def _checked(
    msg: pb.Tensor,
    field: str,
    dtypes: Sequence[int],
    shape: Sequence[int | None] | None,
    max_bytes: int,
    required: bool,
) -> tuple[list[int], bytes]:
    """check_header's work; also returns the data bytes, so that decode reads them from the same
    copy (each read of a bytes field copies it out of the message)."""
    # ByteSize() serialises the whole message (a copy of the data); a set dtype or shape already
    # says the tensor is there, so only one without them pays for it.
    if required and not (msg.dtype or len(msg.shape)) and not msg.ByteSize():
        raise InvalidArgument(field, "required tensor is missing")
    if msg.dtype not in WIRE_DTYPES:
        name = pb.DType.Name(msg.dtype) if msg.dtype in pb.DType.values() else str(msg.dtype)
        raise InvalidArgument(field, f"dtype {name} is not a known wire dtype")
    if msg.dtype not in dtypes:
        allowed = ", ".join(pb.DType.Name(d) for d in dtypes)
        raise InvalidArgument(
            field, f"dtype {pb.DType.Name(msg.dtype)} not allowed (want {allowed})"
        )
    dims = list(msg.shape)
    if any(d < 0 for d in dims):
        raise InvalidArgument(field, f"negative dimension in shape {dims}")
    if shape is not None:
        if len(dims) != len(shape):
            raise InvalidArgument(field, f"rank {len(dims)} (shape {dims}), want rank {len(shape)}")
        for i, (got, want) in enumerate(zip(dims, shape, strict=True)):
            if want is not None and got != want:
                raise InvalidArgument(field, f"dimension {i} is {got}, want {want} (shape {dims})")
    itemsize = WIRE_DTYPES[msg.dtype].itemsize
    expected = math.prod(dims) * itemsize
    if expected > max_bytes:
        raise InvalidArgument(field, f"{expected} bytes exceeds the {max_bytes}-byte limit")
    data = msg.data
    if len(data) != expected:
        raise InvalidArgument(
            field,
            f"{len(data)} data bytes, but shape {dims} x {itemsize} needs {expected}",
        )
    return dims, data


def decode(
    msg: pb.Tensor,
    field: str,
    *,
    dtypes: Sequence[int] = FLOAT_DTYPES,
    shape: Sequence[int | None] | None = None,
    finite: bool = True,
    max_bytes: int = MAX_TENSOR_BYTES,
    required: bool = True,
) -> np.ndarray:
    """Decode and validate one tensor field; returns a read-only-safe native-endian copy.

    `shape` fixes the rank; an int entry fixes that dimension, None leaves it free.
    """
    dims, data = _checked(msg, field, dtypes, shape, max_bytes, required)
    np_dtype = WIRE_DTYPES[msg.dtype]
    array = np.frombuffer(data, dtype=np_dtype).reshape(dims).astype(np_dtype.newbyteorder("="))
    if finite and array.dtype.kind == "f" and array.size and not np.isfinite(array).all():
        bad = int(np.flatnonzero(~np.isfinite(array.reshape(-1)))[0])
        raise InvalidArgument(field, f"non-finite value at flat index {bad}")
    return array


def check_token_ids(ids: np.ndarray, field: str) -> np.ndarray:
    """Token ids (any integer dtype) must lie in 0..VOCAB_SIZE-1; returns them as int64. The
    range is checked before the cast, so a uint64 id past 2^63 is refused as itself rather than
    wrapped to a negative one."""
    ids = np.asarray(ids)
    bad = np.flatnonzero((ids < 0) | (ids >= VOCAB_SIZE))
    if bad.size:
        i = int(bad[0])
        raise InvalidArgument(f"{field}[{i}]", f"id {int(ids[i])} outside 0..{VOCAB_SIZE - 1}")
    return ids.astype(np.int64, copy=False)


def decode_tokens(msg: pb.Tensor, field: str, *, min_len: int = 1, max_len: int) -> np.ndarray:
    ids = decode(msg, field, dtypes=INT_DTYPES, shape=(None,), max_bytes=max_len * 8)
    if ids.shape[0] < min_len:
        raise InvalidArgument(field, f"{ids.shape[0]} tokens, need at least {min_len}")
    if ids.shape[0] > max_len:
        raise InvalidArgument(field, f"{ids.shape[0]} tokens exceeds the limit of {max_len}")
    return check_token_ids(ids, field)


@dataclass(frozen=True)
class VoiceData:
    """A validated voice: what the CosyVoice3 frontend makes from a prompt recording."""

    prompt_token: np.ndarray  # [n_p] int64, ids in 0..6560
    prompt_feat: np.ndarray  # [2 * n_p, 80] float32 log-mel
    embedding: np.ndarray  # [192] float32 speaker x-vector

    @property
    def num_prompt_tokens(self) -> int:
        return int(self.prompt_token.shape[0])

    @cached_property
    def voice_id(self) -> str:
        """Content address: equal tensors give equal ids on every replica (hashed once)."""
        h = hashlib.blake2b(digest_size=16)
        for part in (
            self.prompt_token.astype("<i8"),
            self.prompt_feat.astype("<f4"),
            self.embedding.astype("<f4"),
        ):
            h.update(np.ascontiguousarray(part).tobytes())
        return "v1-" + h.hexdigest()

    def to_proto(self) -> pb.Voice:
        return pb.Voice(
            prompt_token=encode(self.prompt_token.astype(np.int32)),
            prompt_feat=encode(self.prompt_feat),
            embedding=encode(self.embedding),
        )


def make_voice(prompt_token, prompt_feat, embedding, field: str = "voice") -> VoiceData:
    """Validate voice arrays (from the wire or an .npz file) and build a VoiceData."""
    tokens = np.asarray(prompt_token)
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise InvalidArgument(
            f"{field}.prompt_token", f"want a 1-D integer array, got {tokens.dtype} {tokens.shape}"
        )
    n_p = tokens.shape[0]
    if not 1 <= n_p <= MAX_PROMPT_TOKENS:
        raise InvalidArgument(f"{field}.prompt_token", f"{n_p} tokens, want 1..{MAX_PROMPT_TOKENS}")
    tokens = check_token_ids(tokens, f"{field}.prompt_token")
    feat = np.asarray(prompt_feat)
    if feat.ndim != 2 or feat.shape[1] != MEL_BINS or feat.dtype.kind != "f":
        raise InvalidArgument(
            f"{field}.prompt_feat",
            f"want float (frames, {MEL_BINS}), got {feat.dtype} {feat.shape}",
        )
    if feat.shape[0] != TOKEN_MEL_RATIO * n_p:
        raise InvalidArgument(
            f"{field}.prompt_feat",
            f"{feat.shape[0]} frames, want {TOKEN_MEL_RATIO} x {n_p} prompt tokens = {TOKEN_MEL_RATIO * n_p}",
        )
    emb = np.asarray(embedding)
    if emb.shape != (SPK_EMBED_DIM,) or emb.dtype.kind != "f":
        raise InvalidArgument(
            f"{field}.embedding", f"want float ({SPK_EMBED_DIM},), got {emb.dtype} {emb.shape}"
        )
    for name, arr in (("prompt_feat", feat), ("embedding", emb)):
        if not np.isfinite(arr).all():
            raise InvalidArgument(f"{field}.{name}", "non-finite value")
    if not np.any(emb):
        raise InvalidArgument(f"{field}.embedding", "all zeros (cannot be L2-normalised)")
    return VoiceData(tokens, feat.astype(np.float32), emb.astype(np.float32))


def decode_voice(msg: pb.Voice, field: str = "voice") -> VoiceData:
    tokens = decode(msg.prompt_token, f"{field}.prompt_token", dtypes=INT_DTYPES, shape=(None,))
    feat = decode(msg.prompt_feat, f"{field}.prompt_feat", shape=(None, MEL_BINS))
    emb = decode(msg.embedding, f"{field}.embedding", shape=(SPK_EMBED_DIM,))
    return make_voice(tokens, feat, emb, field)
