"""The committed generated code matches the protos, and pyproject's runtime pins admit it."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

from grpc_api import codegen
from grpc_api.v1 import admin_pb2, decoding_pb2

ROOT = Path(codegen.__file__).resolve().parent.parent


def test_regeneration_leaves_no_diff(tmp_path: Path) -> None:
    codegen.generate(tmp_path)
    assert codegen.diff(tmp_path) == [], "run `python -m grpc_api.codegen` and commit the result"


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def _lower_bound(requirement: str) -> tuple[int, ...]:
    match = re.search(r">=\s*([\d.]+)", requirement)
    assert match, f"no lower bound in {requirement!r}"
    return _version(match.group(1))


def test_runtime_pins_match_generated_code() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    by_name = {re.split(r"[<>=!~ ]", d, maxsplit=1)[0]: d for d in deps}
    pb2 = (ROOT / "grpc_api" / "v1" / "decoding_pb2.py").read_text()
    gencode = re.search(r"Protobuf Python Version: ([\d.]+)", pb2)
    assert gencode
    protobuf_pin = by_name["protobuf"]
    assert _lower_bound(protobuf_pin) >= _version(gencode.group(1)), protobuf_pin
    major = _version(gencode.group(1))[0]
    assert f"<{major + 1}" in protobuf_pin.replace(" ", ""), f"{protobuf_pin} must stay below the next major"
    grpc_py = (ROOT / "grpc_api" / "v1" / "decoding_pb2_grpc.py").read_text()
    generated = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_py)
    assert generated
    assert _lower_bound(by_name["grpcio"]) >= _version(generated.group(1))


def test_generated_modules_import_with_the_wire_names() -> None:
    assert decoding_pb2.DESCRIPTOR.services_by_name["DecodingService"].full_name == "reprise.v1.DecodingService"
    assert admin_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name == "reprise.v1.AdminService"
    # proto3 `optional`: an explicit 0 is distinguishable from unset.
    params = decoding_pb2.SamplingParams(temperature=0.0)
    assert params.HasField("temperature") and not params.HasField("top_p")
