"""`python -m bench` is one tool: its --help names every subcommand, and each subcommand's
--help works and names itself as `python -m bench NAME` (in-process, no model is built)."""

import pytest

from bench.__main__ import TOOLS, build_parser, main

# The subcommands with flags of their own in bench/__main__.py, beside the scripts in TOOLS.
OWN = ("sweep", "poisson", "smoke", "capacity", "report")


def test_top_level_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in (*OWN, *TOOLS):
        assert f"    {name} " in out or f"    {name}\n" in out, name


@pytest.mark.parametrize("name", OWN)
def test_own_subcommand_help(name, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([name, "--help"])
    assert exc.value.code == 0
    assert f"usage: python -m bench {name}" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(TOOLS))
def test_tool_subcommand_help(name, capsys):
    assert main([name, "--help"]) == 0
    out = capsys.readouterr().out
    assert f"usage: python -m bench {name}" in out
    assert "--" in out.split("usage:", 1)[1]  # it lists flags, it did not run the benchmark


def test_tool_subcommand_names_a_bad_flag(capsys):
    assert main(["flow-model", "--bogus"]) == 2
    assert "--bogus" in capsys.readouterr().err


def test_docs_name_only_commands_that_exist():
    """Every `python -m bench NAME` in the docs, scripts and bench/ names a subcommand, and none
    runs a bench file directly (those have no entry point of their own)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = [*root.glob("*.md"), *root.glob("docs/**/*.md"), *root.glob("bench/*.py")]
    files += [*root.glob("bench/*.sh"), root / "Makefile"]
    known = {*OWN, *TOOLS}
    seen = set()
    for path in files:
        text = path.read_text()
        old = re.findall(r"python3? (?:bench/\w+\.py|-m bench\.\w+)", text)
        assert not old, f"{path.relative_to(root)}: {old}"
        for name in re.findall(r"python3? -m bench ([a-z][a-z-]*)", text):
            assert name in known, f"{path.relative_to(root)}: python -m bench {name}"
            seen.add(name)
    assert {"sweep", "capacity", "flow-model", "simulate"} <= seen  # the scan found the docs
