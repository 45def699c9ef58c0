"""Test fixtures for the voice front end: tiny stand-ins for upstream's two ONNX models (same
input/output count, dtypes, ranks and dynamic axes, built with the onnx helper API) and a
synthetic voiced prompt recording."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from token2wav.frontend.models import SPEAKER_FILE, TOKENIZER_FILE


def write_tiny_models(folder: Path, vocab: int = 6561, scale: float = 9973.0) -> Path:
    """speech_tokenizer_v3.onnx: feats float32 (1, 128, T), feats_length int32 (1,) -> indices
    int64 (1, ceil(len / 4)) in 0..6560 (a function of the features, like the real one at
    25 Hz). campplus.onnx: input float32 (1, T, 80) -> output float32 (1, 192)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    folder.mkdir(parents=True, exist_ok=True)
    opset = [helper.make_operatorsetid("", 17)]
    c = numpy_helper.from_array
    tok_nodes = [
        helper.make_node("ReduceMean", ["feats"], ["m"], axes=[1], keepdims=0),  # (1, T)
        helper.make_node("Cast", ["feats_length"], ["len64"], to=TensorProto.INT64),
        helper.make_node("Slice", ["m", "zero", "len64", "one", "four"], ["s"]),  # (1, T/4)
        helper.make_node("Mul", ["s", "scale"], ["scaled"]),
        helper.make_node("Abs", ["scaled"], ["a"]),
        helper.make_node("Cast", ["a"], ["ai"], to=TensorProto.INT64),
        helper.make_node("Mod", ["ai", "vocab"], ["indices"]),
    ]
    tok_graph = helper.make_graph(
        tok_nodes,
        "tiny_speech_tokenizer",
        [
            helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, "T"]),
            helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1]),
        ],
        [helper.make_tensor_value_info("indices", TensorProto.INT64, [1, "N"])],
        initializer=[
            c(np.array([0], np.int64), "zero"),
            c(np.array([1], np.int64), "one"),
            c(np.array([4], np.int64), "four"),
            c(np.array(scale, np.float32), "scale"),
            c(np.array(vocab, np.int64), "vocab"),
        ],
    )
    onnx.save(
        helper.make_model(tok_graph, opset_imports=opset, ir_version=8), folder / TOKENIZER_FILE
    )
    w = np.random.default_rng(0).standard_normal((80, 192)).astype(np.float32)
    spk_graph = helper.make_graph(
        [
            helper.make_node("Mul", ["input", "input"], ["sq"]),
            helper.make_node("ReduceMean", ["sq"], ["energy"], axes=[1], keepdims=0),  # (1, 80)
            helper.make_node("MatMul", ["energy", "w"], ["output"]),  # (1, 192)
        ],
        "tiny_campplus",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, "T", 80])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 192])],
        initializer=[c(w, "w")],
    )
    onnx.save(
        helper.make_model(spk_graph, opset_imports=opset, ir_version=8), folder / SPEAKER_FILE
    )
    return folder


def voiced_signal(seconds=2.0, sample_rate=24000, channels=1, seed=0, f0=140.0) -> np.ndarray:
    """A vowel-like test prompt: a glottal-ish harmonic series with vibrato, formant-shaped
    harmonic amplitudes, syllable-rate amplitude modulation and a faint noise floor.
    Returns (samples,) or (samples, channels) float32 in [-1, 1]."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    pitch = f0 * (1 + 0.03 * np.sin(2 * np.pi * 5 * t))
    phase = 2 * np.pi * np.cumsum(pitch) / sample_rate
    x = np.zeros_like(t)
    for h in range(1, 40):
        freq = h * f0
        if freq > sample_rate / 2 * 0.9:
            break
        gain = sum(
            np.exp(-(((freq - f) / bw) ** 2)) for f, bw in ((700, 150), (1200, 200), (2600, 300))
        )
        x += (0.2 / h + gain) * np.sin(h * phase)
    x *= 0.5 + 0.5 * np.sin(2 * np.pi * 3 * t) ** 2
    x = 0.5 * x / np.abs(x).max() + 0.003 * rng.standard_normal(t.size)
    if channels == 1:
        return x.astype(np.float32)
    return np.stack([x * (1 - 0.1 * c) for c in range(channels)], axis=1).astype(np.float32)


def wav_bytes(samples: np.ndarray, sample_rate: int, fmt: str = "WAV", subtype=None) -> bytes:
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, samples, sample_rate, format=fmt, subtype=subtype)
    return buf.getvalue()
