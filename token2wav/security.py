"""TLS, mutual TLS and authentication for the three services (all optional, all off by default
for local runs).

- Listener TLS: `--tls-cert`/`--tls-key` (PEM files, re-read when they change on disk, so a
  renewed certificate is used by new connections without a restart); `--tls-client-ca` also
  demands a client certificate signed by that CA (mutual TLS: the internal services accept only
  a gateway holding such a certificate).
- Gateway -> flow/vocoder channels: `--internal-ca` (verify the replicas), `--internal-cert` /
  `--internal-key` (the gateway's client certificate), `--internal-server-name` (the name the
  replicas' certificates carry, when they are dialled by IP).
- Bearer tokens on the gateway: `--auth-tokens FILE`, one `NAME TOKEN [METHOD,...]` per line
  (methods: Synthesize, RegisterVoice, DeleteVoice; none listed = all). No or unknown token:
  UNAUTHENTICATED; a method the token does not list: PERMISSION_DENIED. NAME is the client's
  identity for the per-client limits and voice ownership. Reflection (`--reflection`, off by
  default) needs a valid token too; health needs none.
- Vocoder control calls (CancelSession, ExportSession, ImportSession): `--control-clients NAME,...`
  accepts them only from a peer whose verified client certificate names one of NAME (common
  name or DNS SAN): an authenticated gateway. Needs `--tls-client-ca`.
"""

from __future__ import annotations

import asyncio
import contextvars
import hmac
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import grpc

from token2wav.errors import ServiceError, announce_status

logger = logging.getLogger(__name__)

# The caller's authenticated identity (token name), set around each handler by AuthInterceptor.
identity_var: contextvars.ContextVar[str] = contextvars.ContextVar("identity", default="")


class Unauthenticated(ServiceError):
    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(ServiceError):
    code = grpc.StatusCode.PERMISSION_DENIED


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{what} {path!r}: {exc.strerror or exc}") from None


# -- listeners ------------------------------------------------------------------------------


class _ReloadingCert:
    """Serves the current cert/key pair; grpc asks on every new handshake and we answer with a
    new configuration only when a file's mtime changed."""

    def __init__(self, cert: str, key: str, client_ca: str | None):
        self.files = [f for f in (cert, key, client_ca) if f]
        self.cert, self.key, self.client_ca = cert, key, client_ca
        self._stamp = self._mtimes()

    def _mtimes(self) -> tuple[float, ...]:
        return tuple(os.stat(f).st_mtime_ns for f in self.files)

    def config(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration(
            [(_read(self.key, "--tls-key"), _read(self.cert, "--tls-cert"))],
            _read(self.client_ca, "--tls-client-ca") if self.client_ca else None,
        )

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        try:
            stamp = self._mtimes()
            if stamp == self._stamp:
                return None
            config = self.config()
        except (OSError, ValueError) as exc:  # half-written file: keep the old pair
            logger.warning("TLS files changed but cannot be read (%s); keeping the old ones", exc)
            return None
        self._stamp = stamp
        logger.info("TLS certificate reloaded from %s", self.cert)
        return config


def server_credentials(cert: str, key: str, client_ca: str | None = None) -> grpc.ServerCredentials:
    """TLS for a listener (mutual when `client_ca` is set), reloaded when the files change."""
    reloading = _ReloadingCert(cert, key, client_ca)
    return grpc.dynamic_ssl_server_credentials(
        reloading.config(), reloading.fetch, require_client_authentication=bool(client_ca)
    )


def channel_credentials(
    ca: str | None, cert: str | None = None, key: str | None = None
) -> grpc.ChannelCredentials:
    """TLS for a client channel: verify the server with `ca` (None: the system roots), present
    `cert`/`key` for mutual TLS."""
    if bool(cert) != bool(key):
        raise ValueError("a client certificate needs both its cert and key files")
    return grpc.ssl_channel_credentials(
        _read(ca, "CA file") if ca else None,
        _read(key, "client key") if key else None,
        _read(cert, "client cert") if cert else None,
    )


def peer_names(context: grpc.aio.ServicerContext) -> set[str]:
    """Names in the peer's verified client certificate (common name and SANs); empty without
    mutual TLS."""
    auth = context.auth_context() or {}
    names = set()
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        names.update(v.decode() if isinstance(v, bytes) else str(v) for v in auth.get(key, ()))
    return names


# -- bearer tokens -------------------------------------------------------------------------


@dataclass(frozen=True)
class Token:
    name: str
    secret: bytes
    methods: frozenset[str]  # empty: every method


def load_tokens(path: str) -> list[Token]:
    """`NAME TOKEN [METHOD,...]` per line; blank lines and `#` comments skipped."""
    tokens = []
    for n, line in enumerate(_read(path, "--auth-tokens").decode().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) not in (2, 3) or len(parts[1]) < 16:
            raise ValueError(
                f"--auth-tokens {path}:{n}: want NAME TOKEN [METHOD,...] with a token of at "
                "least 16 characters"
            )
        methods = frozenset(parts[2].split(",")) if len(parts) == 3 else frozenset()
        tokens.append(Token(parts[0], parts[1].encode(), methods))
    if not tokens:
        raise ValueError(f"--auth-tokens {path}: no tokens")
    return tokens


async def refuse_stream(requests, context, exc: Exception, drain_s: float = 2.0) -> None:
    """Before refusing a client-streaming call: the status in the headers, and the client's
    messages read (discarded) until it half-closes, so its writes cannot race the end of the
    call (grpc/grpc#36066)."""
    await announce_status(context, exc)

    async def drain() -> None:
        async for _ in requests:
            pass

    try:
        await asyncio.wait_for(drain(), drain_s)
    except (TimeoutError, grpc.RpcError, ServiceError):
        pass


class _Wrapping(grpc.aio.ServerInterceptor):
    """Runs `check(method, context)` inside the handler's task before the handler itself.
    Health stays open (probes hold no token); reflection, when on, is checked like the API:
    it describes every method, which is no business of an unauthenticated caller."""

    skip = ("/grpc.health",)

    async def check(self, method: str, context) -> None:
        raise NotImplementedError

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(self.skip):
            return handler
        check = self.check

        def unary(behavior):
            async def call(request, context):
                await check(method, context)
                return await behavior(request, context)

            return call

        def stream(behavior, streaming_request: bool):
            async def call(request, context):
                try:
                    await check(method, context)
                except ServiceError as exc:
                    if streaming_request:
                        await refuse_stream(request, context, exc)
                    raise
                async for item in behavior(request, context):
                    yield item

            return call

        kw = dict(
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(stream(handler.unary_stream, False), **kw)
        return grpc.stream_stream_rpc_method_handler(stream(handler.stream_stream, True), **kw)


class TokenAuth(_Wrapping):
    """Bearer tokens (`authorization: Bearer TOKEN`); sets `identity_var` to the token's name."""

    def __init__(self, tokens: Iterable[Token]):
        self.tokens = list(tokens)

    def _find(self, secret: bytes) -> Token | None:
        found = None
        for token in self.tokens:  # compare with every token: no timing hint of which matched
            if hmac.compare_digest(token.secret, secret):
                found = token
        return found

    async def check(self, method: str, context) -> None:
        header = dict(context.invocation_metadata() or ()).get("authorization", "")
        scheme, _, secret = header.partition(" ")
        if scheme.lower() != "bearer" or not secret:
            raise Unauthenticated("missing `authorization: Bearer TOKEN` metadata")
        token = self._find(secret.strip().encode())
        if token is None:
            raise Unauthenticated("unknown bearer token")
        name = method.rsplit("/", 1)[-1]
        if token.methods and name not in token.methods:
            raise PermissionDenied(f"this token may not call {name}")
        identity_var.set(token.name)


class PeerCertAuth(_Wrapping):
    """`methods` only from peers whose verified client certificate names one of `names`."""

    def __init__(self, methods: Iterable[str], names: Iterable[str]):
        self.methods = set(methods)
        self.names = set(names)

    async def check(self, method: str, context) -> None:
        if method.rsplit("/", 1)[-1] not in self.methods:
            return
        names = peer_names(context)
        if not names:
            raise Unauthenticated("control calls need a client certificate (mutual TLS)")
        if not names & self.names:
            raise PermissionDenied("this client certificate may not make control calls")
        identity_var.set(sorted(names & self.names)[0])
