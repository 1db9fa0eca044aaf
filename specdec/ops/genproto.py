"""Regenerate the gRPC stubs in specdec/v1 from protos/, or check that they are current.

    python -m specdec.ops.genproto          # regenerate
    python -m specdec.ops.genproto --check  # exit 1 if the committed stubs are stale
"""

from __future__ import annotations

import argparse
import filecmp
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]  # specdec/ops/genproto.py -> the repository
PROTO_ROOT = ROOT / "protos"
PACKAGE_DIR = pathlib.Path("specdec") / "v1"


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    from grpc_tools import protoc
    import grpc_tools

    protos = sorted((PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out_dir / PACKAGE_DIR).glob("*_pb2*.py*"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the stubs are stale")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = pathlib.Path(tmp)
        fresh = generate(tmp_path)
        committed = ROOT / PACKAGE_DIR
        stale = []
        for f in fresh:
            target = committed / f.name
            if not target.exists() or not filecmp.cmp(f, target, shallow=False):
                stale.append(f.name)
        extra = {p.name for p in committed.glob("*_pb2*.py*")} - {f.name for f in fresh}
        stale += sorted(extra)
        if args.check:
            if stale:
                print(f"stale gRPC stubs: {', '.join(stale)}; run: python -m specdec.ops.genproto", file=sys.stderr)
                return 1
            print("gRPC stubs are up to date")
            return 0
        for name in extra:
            (committed / name).unlink()
        for f in fresh:
            (committed / f.name).write_bytes(f.read_bytes())
        print(f"wrote {len(fresh)} files to {committed}")
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
