"""Make a local CA and the certificates for running the stack with TLS and authentication.

    python deploy/make_certs.py --out deploy/tls     # then:
    docker compose -f docker-compose.yml -f deploy/compose.tls.yml up

Writes (PEM): ca.crt / ca.key (the CA; keep ca.key off the containers), server.crt /
server.key (one certificate for every service, with the compose service names, localhost and
127.0.0.1 as names), gateway.crt / gateway.key (the gateway's client certificate for mutual TLS;
the vocoder accepts control calls from it), and tokens.txt (one random bearer token, `client`).
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

SERVER_NAMES = ("token2wav", "flow", "vocoder", "gateway", "localhost", "127.0.0.1")


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
    server_names=SERVER_NAMES,
    clients=("gateway",),
    days: int = 365,
) -> dict[str, tuple[str, str]]:
    """A CA, a server certificate for `server_names` (DNS names or IPs) and one client
    certificate per name in `clients`; returns stem -> (cert file, key file)."""
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

    files["server"] = _write(out, "server", *leaf(server_names[0], server_names))
    for name in clients:
        files[name] = _write(out, name, *leaf(name, [name]))
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
        help="extra DNS name or IP for the server certificate (repeatable)",
    )
    a = p.parse_args(argv)
    out = Path(a.out)
    files = make_pki(out, (*SERVER_NAMES, *a.server_name), ("gateway",), a.days)
    tokens = out / "tokens.txt"
    tokens.write_text(f"# NAME TOKEN [METHOD,...]\nclient {secrets.token_urlsafe(32)}\n")
    tokens.chmod(0o600)
    for stem, (crt, key) in files.items():
        print(f"{stem:8s} {crt} {key}")
    print(f"tokens   {tokens} (give the client's token to AsyncClient(token=...))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
