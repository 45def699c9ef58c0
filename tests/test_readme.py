"""The README's quick start and client commands, run as written (issue 19: the README must not
drift from the code again).

Every ```sh block right after a `<!-- readme-test: KIND ... -->` comment in README.md is run by
bash (-e -u -o pipefail), in a fresh copy of the working tree (what git would commit: tracked
and untracked-but-not-ignored files; no .venv, no out/). A new block gets covered by adding the
marker. KIND says what the block needs:

- `fresh-copy`: nothing else. `make test` is dry-run (`make -n test`: this test is part of it).
- `client`: a running gateway; the test starts the three services (small random-weight models)
  on a free port and points the block's `127.0.0.1:50051` at it.
- `skip (why)`: not run here (real model files, say); the marker says why.

Installing the venv is what these runs leave out (minutes, and a network): `.venv` in the copy
is the virtual environment running this test, with make's stamp saying it is installed, so
`make run` starts at its real work.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
import wave
from pathlib import Path

import pytest
import test_gateway
from test_gateway import start_stack

from token2wav import SAMPLE_RATE

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MARKED = re.compile(r"<!-- readme-test: (\S+)[^>]*-->\n```sh\n(.*?)```", re.S)
KINDS = ("fresh-copy", "client", "skip")
models = test_gateway.models  # the small models, loaded once per module (a fixture)


def marked_blocks() -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in MARKED.finditer(README)]


def test_the_quick_start_and_client_blocks_are_marked():
    kinds = [kind for kind, _ in marked_blocks()]
    assert set(kinds) <= set(KINDS), kinds
    assert "fresh-copy" in kinds and "client" in kinds
    # Every sh block of the two sections is marked (a new one without the marker would slip by).
    for section in ("## The two commands", "## The client"):
        start = README.index(section)
        text = README[start : README.index("\n## ", start + 1)]
        for m in re.finditer(r"(.*)\n```sh\n", text):
            assert m.group(1).startswith("<!-- readme-test:"), f"unmarked block in {section}"


@pytest.fixture
def fresh_copy(tmp_path) -> Path:
    if sys.prefix == sys.base_prefix:
        pytest.skip("the README's commands use .venv/bin: run the tests in a virtual environment")
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    dest = tmp_path / "token2wav"
    for name in filter(None, (f.decode() for f in files)):
        src = ROOT / name
        if src.is_file():  # a file deleted in the working tree is still listed by git
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    # .venv: the test's own virtual environment, entry by entry, with make's "installed" stamp
    # of its own (newer than the copy's pyproject.toml), so make installs nothing.
    venv = dest / ".venv"
    venv.mkdir()
    for entry in Path(sys.prefix).iterdir():
        if entry.name != ".installed":
            (venv / entry.name).symlink_to(entry)
    (venv / ".installed").touch()
    return dest


def run_block(block: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        PYTHONPATH=str(cwd),  # the copy's code, whatever the venv's editable install points at
        RUN_ARGS="--free-ports",  # `make run` beside other services on this machine
    )
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def wav_seconds(path: Path) -> float:
    with wave.open(str(path)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (SAMPLE_RATE, 1, 2)
        return w.getnframes() / SAMPLE_RATE


def test_quick_start_runs_as_written(fresh_copy):
    for kind, block in marked_blocks():
        if kind != "fresh-copy":
            continue
        block = re.sub(r"^make test\b", "make -n test", block, flags=re.M)
        out = run_block(block, fresh_copy, timeout=300)
        assert out.returncode == 0, f"{block}\n--- stdout\n{out.stdout}\n--- stderr\n{out.stderr}"
        assert "gateway SERVING" in out.stdout and "services stopped" in out.stdout
        assert wav_seconds(fresh_copy / "out/sample.wav") == pytest.approx(10.0)


def test_client_section_runs_as_written(models, fresh_copy):
    async def main():
        stack = await start_stack(models)
        try:
            for kind, block in marked_blocks():
                if kind != "client":
                    continue
                assert "127.0.0.1:50051" in block
                block = block.replace("127.0.0.1:50051", stack.target)
                out = await asyncio.to_thread(run_block, block, fresh_copy, 120)
                assert out.returncode == 0, f"{block}\n{out.stdout}\n{out.stderr}"
        finally:
            await stack.stop()

    asyncio.run(main())
    assert wav_seconds(fresh_copy / "out.wav") == pytest.approx(10.0)
    assert (fresh_copy / "out.opus").read_bytes()[:4] == b"OggS"  # the Formats block
