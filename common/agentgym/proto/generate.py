"""Generate the Python protobuf/gRPC modules from `proto/agentgym/proto/*.proto`.

Usage: ``python -m agentgym.proto.generate OUT_DIR`` writes ``OUT_DIR/agentgym/proto/*_pb2*.py(i)``.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
PROTO_ROOT = REPO_ROOT / "proto"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "agentgym" / "proto").glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Run protoc (from grpcio-tools) and return the files it wrote."""
    import grpc_tools
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    include_std = Path(grpc_tools.__file__).parent / "_proto"
    sources = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include_std}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *sources,
    ]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}: {' '.join(args)}")
    generated = sorted((out_dir / "agentgym" / "proto").glob("*_pb2*.py*"))
    return generated


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT / "common"
    for path in generate(out):
        print(path)


if __name__ == "__main__":
    main()
