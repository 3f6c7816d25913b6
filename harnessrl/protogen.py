"""Generates the Python code for the contract in `protos/` into `harnessrl/v1/`.

Run `python -m harnessrl.protogen` after editing a .proto file. The generated files are
committed and never edited by hand; `tests/test_protos.py` regenerates them into a temporary
folder and fails on any difference.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "protos"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "harnessrl" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Compiles every proto into `out_dir` (as `out_dir/harnessrl/v1/...`); returns the files."""
    import grpc_tools
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted((out_dir / "harnessrl" / "v1").glob("*_pb2*"))


def main() -> int:
    files = generate(REPO)
    for f in files:
        print(f.relative_to(REPO))
    return 0


if __name__ == "__main__":
    sys.exit(main())
