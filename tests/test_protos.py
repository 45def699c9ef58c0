"""The contract: committed stubs are what `make protos` generates, and every field is documented."""

import filecmp
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTOS = sorted((ROOT / "protos" / "token2wav" / "v1").glob("*.proto"))


def test_stubs_are_fresh(tmp_path):
    assert PROTOS, "no .proto files found"
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{ROOT / 'protos'}",
        f"--python_out={tmp_path}",
        f"--pyi_out={tmp_path}",
        f"--grpc_python_out={tmp_path}",
        *map(str, PROTOS),
    ]
    subprocess.run(cmd, check=True)
    generated = sorted((tmp_path / "token2wav" / "v1").glob("*"))
    assert len(generated) == 3 * len(PROTOS)
    stale = [
        p.name
        for p in generated
        if not filecmp.cmp(p, ROOT / "token2wav" / "v1" / p.name, shallow=False)
    ]
    assert not stale, f"stale stubs (run `make protos`): {stale}"


FIELD = re.compile(r"^\s*(?:repeated\s+|optional\s+)?[\w.]+\s+(\w+)\s*=\s*\d+\s*;")


def test_every_field_and_enum_value_is_commented():
    undocumented = []
    for path in PROTOS:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            code = line.split("//")[0]
            is_field = FIELD.match(code) is not None
            is_enum_value = re.match(r"^\s*[A-Z0-9_]+\s*=\s*\d+\s*;", code) is not None
            if not (is_field or is_enum_value):
                continue
            trailing = "//" in line
            above = i > 0 and lines[i - 1].strip().startswith("//")
            # Self-explanatory one-field messages (e.g. CancelSessionRequest.request_id) are
            # documented by the service comment; everything else needs its own comment.
            msg_start = next(
                j for j in range(i, -1, -1) if re.match(r"^\s*(message|enum)\s", lines[j])
            )
            self_evident = lines[msg_start + 1 : i] == [] and lines[i + 1].strip() == "}"
            if not (trailing or above or self_evident):
                undocumented.append(f"{path.name}:{i + 1}: {line.strip()}")
    assert not undocumented, "fields without a comment:\n" + "\n".join(undocumented)


def test_stubs_import_and_services_exist():
    from token2wav.v1 import flow_pb2, gateway_pb2, vocoder_pb2

    assert set(gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].methods_by_name) == {
        "Synthesize",
        "RegisterVoice",
        "DeleteVoice",
    }
    assert set(flow_pb2.DESCRIPTOR.services_by_name["Flow"].methods_by_name) == {"Generate"}
    assert {"Session", "CancelSession", "ExportSession", "ImportSession"} == set(
        vocoder_pb2.DESCRIPTOR.services_by_name["Vocoder"].methods_by_name
    )
    assert gateway_pb2.DESCRIPTOR.package == "token2wav.v1"
