"""vocoder_service: Stage 2 of token2wav (mel -> 24 kHz audio by causal HiFT), one cache session
per stream keyed by request id, chunks joined by seq, sessions batched into shared HiFT calls.

Layers: servicer (proto <-> objects) -> manager (sessions, order, retries, lifetime) and batcher
(what runs in each batch) -> runner (model and device) -> model/ (HiFT, no gRPC)."""
