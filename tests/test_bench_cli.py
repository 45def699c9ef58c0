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
