"""The token2wav benchmark: an asyncio load generator that drives the gateway over gRPC
(closed-loop concurrency sweeps, Poisson arrivals, tokens all at once or LLM-paced), the
metrics users choose a TTS back end by (first-chunk latency, xRT, playback underruns), batching
on vs off in one invocation, JSON + markdown + PNG output. `python -m bench --help`."""
