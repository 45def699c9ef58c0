"""Wire codecs: round trips for every dtype, and each malformed case rejected naming the field."""

import numpy as np
import pytest
import torch

from token2wav.errors import InvalidArgument
from token2wav.tensors import (
    INT_DTYPES,
    WIRE_DTYPES,
    check_header,
    decode,
    decode_tokens,
    decode_voice,
    encode,
    make_voice,
)
from token2wav.v1 import common_pb2 as pb


@pytest.mark.parametrize("wire", sorted(WIRE_DTYPES))
def test_round_trip_each_dtype(wire):
    rng = np.random.default_rng(wire)
    dtype = WIRE_DTYPES[wire].newbyteorder("=")
    if dtype.kind == "f":
        arr = rng.standard_normal((3, 5)).astype(dtype)
    else:
        info = np.iinfo(dtype)
        arr = rng.integers(info.min, info.max, size=(3, 5), dtype=dtype, endpoint=True)
    msg = encode(arr)
    assert msg.dtype == wire
    assert list(msg.shape) == [3, 5]
    # Bytes on the wire are little-endian whatever the host.
    assert msg.data == arr.astype(WIRE_DTYPES[wire]).tobytes()
    out = decode(pb.Tensor.FromString(msg.SerializeToString()), "x", dtypes=[wire])
    assert out.dtype == dtype and np.array_equal(out, arr)


def test_torch_round_trip_and_empty():
    t = torch.randn(80, 7)
    assert torch.equal(torch.from_numpy(decode(encode(t), "mel", shape=(80, None))), t)
    empty = decode(encode(np.zeros((80, 0), np.float32)), "mel", shape=(80, None))
    assert empty.shape == (80, 0)


def test_bfloat16_is_widened_and_bool_refused():
    t = torch.randn(4).to(torch.bfloat16)
    assert decode(encode(t), "x").dtype == np.float32
    with pytest.raises(TypeError):
        encode(np.zeros(3, dtype=bool))


def _bad(msg, match, **kw):
    with pytest.raises(InvalidArgument, match=match) as info:
        decode(msg, "voice.prompt_feat", **kw)
    assert info.value.field == "voice.prompt_feat"
    assert str(info.value).startswith("voice.prompt_feat: ")


def test_rejects_wrong_length():
    msg = encode(np.zeros((2, 80), np.float32))
    msg.data = msg.data[:-4]
    _bad(msg, "data bytes")


def test_rejects_wrong_dtype():
    _bad(encode(np.zeros((2, 80), np.int32)), "not allowed")
    msg = encode(np.zeros((2, 80), np.float32))
    msg.dtype = pb.DTYPE_UNSPECIFIED
    _bad(msg, "not a known wire dtype")


def test_rejects_wrong_rank_and_dim():
    _bad(encode(np.zeros((2, 80, 1), np.float32)), "rank 3", shape=(None, 80))
    _bad(encode(np.zeros((2, 81), np.float32)), "dimension 1 is 81", shape=(None, 80))


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_rejects_non_finite(value):
    arr = np.zeros((2, 80), np.float32)
    arr[1, 3] = value
    _bad(encode(arr), "non-finite value at flat index 83")


def test_rejects_oversize_before_reading_data():
    msg = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[1 << 20, 80], data=b"")
    _bad(msg, "exceeds the", max_bytes=1 << 20)


def test_rejects_missing_and_negative_shape():
    _bad(pb.Tensor(), "missing")
    _bad(pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[-1], data=b""), "negative")
    # Present but without dtype or shape (the cheap presence test falls back to the full one):
    # not missing, refused for what it lacks.
    _bad(pb.Tensor(data=b"\0" * 4), "DTYPE_UNSPECIFIED is not a known")
    # An empty tensor that says its dtype and shape is present (a 0-sample chunk).
    assert decode(pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[0]), "x").shape == (0,)


def test_tokens_range_and_length():
    ok = decode_tokens(encode(np.array([0, 6560], np.int32)), "tokens", max_len=10)
    assert ok.dtype == np.int64 and ok.tolist() == [0, 6560]
    with pytest.raises(InvalidArgument, match=r"tokens\[1\]: id 6561 outside 0..6560"):
        decode_tokens(encode(np.array([5, 6561], np.int64)), "tokens", max_len=10)
    with pytest.raises(InvalidArgument, match="tokens: 0 tokens"):
        decode_tokens(encode(np.zeros(0, np.int32)), "tokens", max_len=10)
    with pytest.raises(InvalidArgument, match="not allowed"):
        decode_tokens(encode(np.zeros(3, np.float32)), "tokens", max_len=10)
    assert set(INT_DTYPES) == {pb.DTYPE_INT32, pb.DTYPE_INT64}


def _voice(n=5, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.integers(0, 6561, n),
        rng.standard_normal((2 * n, 80)).astype(np.float32),
        rng.standard_normal(192).astype(np.float32),
    )


def test_voice_round_trip_and_content_id():
    voice = make_voice(*_voice())
    back = decode_voice(pb.Voice.FromString(voice.to_proto().SerializeToString()))
    assert back.voice_id == voice.voice_id and back.voice_id.startswith("v1-")
    assert make_voice(*_voice(seed=1)).voice_id != voice.voice_id
    assert np.array_equal(back.prompt_feat, voice.prompt_feat)


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda t, f, e: (t, f[:-1], e), "voice.prompt_feat"),  # frames != 2 x tokens
        (lambda t, f, e: (t, f[:, :79], e), "voice.prompt_feat"),
        (lambda t, f, e: (t, f, e[:191]), "voice.embedding"),
        (lambda t, f, e: (t, f, np.zeros(192, np.float32)), "voice.embedding"),
        (
            lambda t, f, e: (np.append(t, 7000), np.concatenate([f, f[:2]]), e),
            "voice.prompt_token[5]",
        ),
        (lambda t, f, e: (t[:0], f[:0], e), "voice.prompt_token"),
    ],
)
def test_voice_rejections_name_the_field(mutate, field):
    with pytest.raises(InvalidArgument) as info:
        make_voice(*mutate(*_voice()))
    assert info.value.field == field


def test_voice_nan_rejected_on_the_wire():
    t, f, e = _voice()
    f[0, 0] = np.nan
    msg = pb.Voice(
        prompt_token=encode(t.astype(np.int32)), prompt_feat=encode(f), embedding=encode(e)
    )
    with pytest.raises(InvalidArgument) as info:
        decode_voice(msg)
    assert info.value.field == "voice.prompt_feat"


def test_check_header_validates_without_decoding():
    msg = encode(np.zeros((80, 3), np.float32))
    assert check_header(msg, "mel", shape=(80, None)) == [80, 3]
    msg.data = msg.data[:-4]
    with pytest.raises(InvalidArgument, match="mel: 956 data bytes"):
        check_header(msg, "mel", shape=(80, None))
    with pytest.raises(InvalidArgument, match="dimension 0 is 3"):
        check_header(encode(np.zeros((3, 80), np.float32)), "mel", shape=(80, None))
