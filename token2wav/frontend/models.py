"""The two ONNX models of upstream's front end, through onnxruntime.

Input and output layout as upstream's `cosyvoice/cli/frontend.py` feeds them (by position, so
whatever the graph calls its inputs):
- speech tokenizer (`speech_tokenizer_v3.onnx`): input 0 the Whisper log-mel, float32
  (1, 128, F); input 1 its frame count, int32 (1,); output 0 the token ids (1, N), any int type.
  CUDA provider when onnxruntime has one, else CPU (upstream: CUDA when torch sees a GPU).
- speaker encoder (`campplus.onnx`): input 0 the mean-normalised fbank, float32 (1, F, 80);
  output 0 the x-vector, float32 (1, 192). CPU, as upstream.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from token2wav.frontend.audio import FrontendUnavailable, require

TOKENIZER_FILE = "speech_tokenizer_v3.onnx"
SPEAKER_FILE = "campplus.onnx"


class ModelOutputError(FrontendUnavailable):
    """An ONNX model gave output of the wrong shape or range: the model folder is wrong."""


def _session(path: Path, providers: list[str], num_threads: int):
    ort = require("onnxruntime")
    if not path.is_file():
        raise FrontendUnavailable(
            f"{path} not found (the folder needs {TOKENIZER_FILE} and "
            f"{SPEAKER_FILE} from Fun-CosyVoice3-0.5B-2512)"
        )
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = num_threads
    opts.inter_op_num_threads = 1
    try:
        sess = ort.InferenceSession(str(path), sess_options=opts, providers=providers)
    except Exception as exc:  # noqa: BLE001 - onnxruntime raises its own exception types
        raise FrontendUnavailable(f"{path}: onnxruntime cannot load it: {exc}") from None
    return sess


def _gpu_first() -> list[str]:
    ort = require("onnxruntime")
    if "CUDAExecutionProvider" in ort.get_available_providers():
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


class SpeechTokenizer:
    def __init__(self, path: Path, num_threads: int = 1, providers: list[str] | None = None):
        self.session = _session(path, providers or _gpu_first(), num_threads)
        inputs = self.session.get_inputs()
        if len(inputs) != 2:
            raise FrontendUnavailable(f"{path}: {len(inputs)} inputs, want 2 (feats, length)")
        self.input_names = [i.name for i in inputs]

    def __call__(self, whisper_mel: np.ndarray) -> np.ndarray:
        """(128, F) float32 -> (N,) int64 token ids."""
        feats = np.ascontiguousarray(whisper_mel[None], dtype=np.float32)  # (1, 128, F)
        length = np.array([feats.shape[2]], dtype=np.int32)  # (1,)
        out = self.session.run(None, dict(zip(self.input_names, (feats, length))))[0]
        out = np.asarray(out)
        if out.dtype.kind not in "iu":
            raise ModelOutputError(f"speech tokenizer gave {out.dtype} output, want token ids")
        return out.reshape(-1).astype(np.int64)


class SpeakerEncoder:
    def __init__(self, path: Path, num_threads: int = 1):
        self.session = _session(path, ["CPUExecutionProvider"], num_threads)
        self.input_name = self.session.get_inputs()[0].name

    def __call__(self, fbank: np.ndarray) -> np.ndarray:
        """(F, 80) float32 -> (192,) float32."""
        feats = np.ascontiguousarray(fbank[None], dtype=np.float32)  # (1, F, 80)
        out = np.asarray(self.session.run(None, {self.input_name: feats})[0])
        return out.reshape(-1).astype(np.float32)
