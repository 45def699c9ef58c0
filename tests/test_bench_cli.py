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


def _numbers(value, path=""):
    """(path, number) of every number in a JSON value."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _numbers(v, f"{path}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _numbers(v, f"{path}[{i}]")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield path, value


# Each part that times one model or one service, at its smallest CPU sizes: the JSON it writes
# and keys the docs and the frozen runs in docs/bench/ read. flow-service and kernels have
# tests of their own (test_bench.py, test_kernels.py), vocoder-latency too (test_vocoder_graphs).
PART_SMOKES = {
    "flow-model": (
        ["--batches", "1", "--generate-repeats", "1"],
        "flow_model_gpu",
        ("env", "chunking", "step", "generate"),
    ),
    "profile-batch": ([], "profile_flow_float32_B2_T206", ("wall_ms", "batch", "frames")),
    "profile-prefix": ([], "profile_prefix", ("frames", "ms")),
    "hift-model": (
        ["--histories", "1", "--batches", "1", "--long-s", "4"],
        "hift_model_gpu",
        ("exact_long_flushed_max_abs", "session_ms_per_100f_hist1s", "batch1_ms_per_step"),
    ),
    "prefix-cache": (
        ["--seconds", "4", "--streams", "2"],
        "prefix_cache_bench",
        ("per_utterance", "generate_only"),
    ),
    "vocoder-service": (
        ["--sessions", "1"],
        "vocoder_service_bench",
        ("env", "reference", "model_only", "load"),
    ),
}


@pytest.mark.parametrize("name", sorted(PART_SMOKES))
def test_part_smoke_writes_its_record(name, tmp_path, capsys):
    import json
    import math

    argv, stem, keys = PART_SMOKES[name]
    assert main([name, "--smoke", *argv, "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / f"{stem}.json").read_text())
    for key in keys:
        assert record[key] not in (None, {}, []), key
    env = record["environment"]
    assert env["command"].startswith(f"python -m bench {name} --smoke")
    assert env["hardware"]["torch"]
    numbers = dict(_numbers({k: record[k] for k in keys}))
    assert numbers, "no figure measured"
    bad = {p: v for p, v in numbers.items() if not math.isfinite(v)}
    assert not bad, bad
    assert '_error"' not in json.dumps(record)  # a path that failed and was only reported
    if name == "hift-model":  # the exactness figures are real: sessions match the full decode
        assert max(v for k, v in record.items() if k.startswith("exact_")) <= 1e-3


def test_parts_share_one_set_of_flags(capsys):
    """Every part that times a model or a service takes the shared flags (bench/parts.py)."""
    shared = ("--device", "--dtype", "--preset", "--model-dir", "--seed", "--repeats")
    shared += ("--warmup", "--out", "--smoke")
    for name in (*PART_SMOKES, "flow-service", "kernels", "vocoder-latency"):
        assert main([name, "--help"]) == 0
        out = capsys.readouterr().out
        assert "shared by every part" in out, name
        for flag in shared:
            assert flag in out, (name, flag)


def test_part_names_a_bad_shared_value(capsys):
    assert main(["profile-batch", "--dtype", "float16"]) == 2
    assert "--dtype" in capsys.readouterr().err
    assert main(["profile-batch", "--dtype", "float32,bfloat16", "--smoke"]) == 2
    assert "one dtype" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "preset"),
    [
        (["sweep"], "small"),
        (["capacity", "--device", "cuda"], "cosyvoice3-0.5b"),
        (["sweep", "--device", "cuda:1"], "cosyvoice3-0.5b"),
        (["poisson", "--device", "cuda", "--preset", "small"], "small"),
    ],
)
def test_stack_runs_default_to_the_full_size_model_on_a_gpu(argv, preset):
    from bench.__main__ import parse_args

    assert parse_args(argv).preset == preset
