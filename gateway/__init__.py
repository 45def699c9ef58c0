"""The token2wav gateway: the public streaming API (`python -m gateway`) and its client
library and CLI (`gateway.client`)."""
