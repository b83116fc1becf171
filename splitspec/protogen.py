"""Generate the Python gRPC stubs of protos/ into splitspec/api/v1/ (the build step of the wire format).

    python -m splitspec.protogen          # regenerate the checked-in stubs
    python -m splitspec.protogen --check  # fail if they differ from the .proto

The stubs are checked in so that an installed package (and every Ray worker)
imports them without a build; tests/test_protos.py runs the check.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PROTO = "splitspec/api/v1/splitspec.proto"
STUBS = Path("splitspec", "api", "v1")
GENERATED = ("splitspec_pb2.py", "splitspec_pb2.pyi", "splitspec_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Run protoc (from grpcio-tools) on the .proto; return the generated files."""
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{Path(protoc.__file__).parent / '_proto'}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        PROTO,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO_ROOT / PROTO}")
    return [out_dir / STUBS / name for name in GENERATED]


def out_of_sync() -> list[str]:
    """Names of the checked-in stubs that differ from a fresh generation."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        return [f.name for f in fresh if not filecmp.cmp(f, ROOT / STUBS / f.name, shallow=False)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that the stubs are in sync")
    args = parser.parse_args(argv)
    if args.check:
        stale = out_of_sync()
        if stale:
            print(f"stale gRPC stubs: {stale}; run `python -m splitspec.protogen`", file=sys.stderr)
            return 1
        print("gRPC stubs are in sync with protos/")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        for f in generate(Path(tmp)):
            (ROOT / STUBS / f.name).write_bytes(f.read_bytes())
            print(f"wrote splitspec/api/v1/{f.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
