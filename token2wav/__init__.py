"""Code shared by the three token2wav services: the wire contract's stubs (`token2wav.v1`),
tensor codecs, typed errors, and the gRPC server bootstrap."""

SAMPLE_RATE = 24000  # Hz, output audio
MEL_BINS = 80
SPK_EMBED_DIM = 192
VOCAB_SIZE = 6561  # speech token ids are 0..VOCAB_SIZE-1
TOKEN_MEL_RATIO = 2  # mel frames per speech token (25 Hz tokens, 50 Hz mel)
SAMPLES_PER_FRAME = 480  # 24 kHz / 50 Hz
SAMPLES_PER_TOKEN = SAMPLES_PER_FRAME * TOKEN_MEL_RATIO  # 960
MAX_PROMPT_TOKENS = 750  # 30 s, the CosyVoice3 frontend's prompt cap
MAX_FRAMES = 15000  # 300 s at 50 Hz: the fixed noise buffers' length
