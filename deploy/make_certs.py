"""Make a local CA and one certificate per identity, for running the stack with TLS and
authentication.

    python deploy/make_certs.py --out deploy/tls     # then:
    docker compose -f docker-compose.yml -f deploy/compose.tls.yml up

Writes (PEM), each key readable by its owner only:
  ca.crt / ca.key                 the CA; ca.key never goes into a container or a Secret
  gateway.crt / gateway.key       the gateway's public listener (names `token2wav`, localhost,
                                  127.0.0.1, and each --server-name)
  gateway-client.crt / .key       the gateway's client certificate towards flow and vocoder;
                                  the only one named `gateway`, the identity the vocoder's
                                  --control-clients accepts
  flow.crt / flow.key             the flow service's listener
  vocoder.crt / vocoder.key       the vocoder service's listener
  tokens.txt                      one random bearer token, `client`
Flow and vocoder certificates carry their service name and `token2wav-internal`, the name the
gateway checks when it dials replicas by IP (--internal-server-name); neither carries
`gateway` or `token2wav`, so a flow or vocoder key can neither make control calls nor pose as
the public gateway. Each service mounts only its own pair and ca.crt.
For a throwaway or local setup only: production certificates come from your own CA (e.g.
cert-manager in Kubernetes). Needs the `cryptography` package (a dev extra).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import secrets
import sys
from pathlib import Path

INTERNAL_NAME = "token2wav-internal"  # what the gateway's --internal-server-name checks
LOCAL = ("localhost", "127.0.0.1")
# stem -> the names of a listener's certificate (the first is its common name)
SERVERS = {
    "gateway": ("token2wav", *LOCAL),
    "flow": ("flow", INTERNAL_NAME, *LOCAL),
    "vocoder": ("vocoder", INTERNAL_NAME, *LOCAL),
}
# stem -> the identity of a client certificate (its common name and only DNS name)
CLIENTS = {"gateway-client": "gateway"}


def _name(cn: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(out: Path, stem: str, cert, key) -> tuple[str, str]:
    from cryptography.hazmat.primitives import serialization

    crt, pem = out / f"{stem}.crt", out / f"{stem}.key"
    crt.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    pem.chmod(0o600)
    return str(crt), str(pem)


def make_pki(
    out: Path,
    servers: dict[str, tuple[str, ...]] | None = None,
    clients: dict[str, str] | None = None,
    days: int = 365,
) -> dict[str, tuple[str, str]]:
    """A CA, one listener certificate per `servers` entry (stem -> DNS names or IPs) and one
    client certificate per `clients` entry (stem -> identity); returns stem -> (cert, key)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("token2wav local CA"))
        .issuer_name(_name("token2wav local CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    files = {"ca": _write(out, "ca", ca, ca_key)}

    def leaf(cn: str, names) -> tuple:
        key = ec.generate_private_key(ec.SECP256R1())
        sans = []
        for n in names:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(n)))
            except ValueError:
                sans.append(x509.DNSName(n))
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        return cert, key

    for stem, names in (SERVERS if servers is None else servers).items():
        files[stem] = _write(out, stem, *leaf(names[0], names))
    for stem, identity in (CLIENTS if clients is None else clients).items():
        files[stem] = _write(out, stem, *leaf(identity, [identity]))
    return files


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python deploy/make_certs.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default="deploy/tls", help="directory to write into")
    p.add_argument("--days", type=int, default=365, help="validity of every certificate")
    p.add_argument(
        "--server-name",
        action="append",
        default=[],
        help="extra DNS name or IP for the gateway's listener certificate (repeatable), e.g. "
        "the name clients dial it by",
    )
    a = p.parse_args(argv)
    out = Path(a.out)
    servers = {**SERVERS, "gateway": (*SERVERS["gateway"], *a.server_name)}
    files = make_pki(out, servers, CLIENTS, a.days)
    tokens = out / "tokens.txt"
    tokens.write_text(f"# NAME TOKEN [METHOD,...]\nclient {secrets.token_urlsafe(32)}\n")
    tokens.chmod(0o600)
    for stem, (crt, key) in files.items():
        print(f"{stem:14s} {crt} {key}")
    print(f"{'tokens':14s} {tokens} (give the client's token to AsyncClient(token=...))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
