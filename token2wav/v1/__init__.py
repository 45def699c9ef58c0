"""Generated gRPC/protobuf stubs for the token2wav.v1 contract (regenerate with `make protos`)."""
