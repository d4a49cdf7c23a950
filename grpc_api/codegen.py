"""Regenerate the committed gRPC/protobuf code from ``grpc_api/v1/*.proto``.

    python -m grpc_api.codegen            # rewrite grpc_api/v1/*_pb2.py, *_pb2_grpc.py, *_pb2.pyi
    python -m grpc_api.codegen --check    # exit 1 if the committed files differ from a fresh build

The generated modules are committed (a fresh install needs no protoc); ``tests/grpc_api/test_codegen.py``
regenerates into a temporary folder and fails on any difference. Generation needs the pinned
``grpcio-tools`` (the ``dev`` extra); the generated code needs ``grpcio`` and ``protobuf`` at least as new
as the versions it names (pyproject.toml pins them).
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from importlib import resources
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "grpc_api" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def proto_files() -> list[Path]:
    """The .proto sources, relative to the repository root (their import paths)."""
    return sorted(p.relative_to(ROOT) for p in PROTO_DIR.glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Compile every proto into ``out_dir`` (laid out as ``grpc_api/v1/...``); return the files written."""
    from grpc_tools import protoc  # a development dependency (the dev extra): only generating code needs it

    well_known = resources.files("grpc_tools") / "_proto"
    files = [str(p) for p in proto_files()]
    args = [
        "protoc",
        f"-I{ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *files,
    ]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code} on {', '.join(files)}")
    return sorted(p for p in (out_dir / "grpc_api" / "v1").iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def diff(fresh_dir: Path) -> list[str]:
    """Names of generated files that differ between ``fresh_dir`` and the committed ones (or are missing)."""
    fresh = {p.name for p in (fresh_dir / "grpc_api" / "v1").iterdir() if p.name.endswith(GENERATED_SUFFIXES)}
    committed = {p.name for p in PROTO_DIR.iterdir() if p.name.endswith(GENERATED_SUFFIXES)}
    bad = sorted(fresh ^ committed)
    for name in sorted(fresh & committed):
        if not filecmp.cmp(fresh_dir / "grpc_api" / "v1" / name, PROTO_DIR / name, shallow=False):
            bad.append(name)
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpc_api.codegen", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with a fresh build, write nothing")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        written = generate(Path(tmp))
        if args.check:
            bad = diff(Path(tmp))
            if bad:
                print(f"generated code is stale: {', '.join(bad)}; run python -m grpc_api.codegen", file=sys.stderr)
                return 1
            return 0
        for path in PROTO_DIR.iterdir():
            if path.name.endswith(GENERATED_SUFFIXES):
                path.unlink()
        for path in written:
            (PROTO_DIR / path.name).write_bytes(path.read_bytes())
            print(f"wrote {(PROTO_DIR / path.name).relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
