#!/usr/bin/env python3
"""Generate the Python stubs of ``protos/loom/v1/*.proto`` into the loom-client package.

Writes ``generation_pb2.py``, ``generation_pb2.pyi``, ``generation_pb2_grpc.py`` and
``generation_pb2_grpc.pyi`` into ``clients/python/src/loom_client/v1/`` (or ``--out``), then
rewrites their absolute ``from loom.v1 import ...`` imports to relative ones: the server's own
package is also called ``loom``, so the proto package path must never be imported as a module.

Needs grpcio-tools at exactly :data:`GRPCIO_TOOLS_VERSION` (stubs made by a newer one refuse to
import under an older grpcio) and mypy-protobuf (``protoc-gen-mypy`` and ``protoc-gen-mypy_grpc``
next to this Python or on PATH).

    python scripts/gen_protos.py            # regenerate the checked-in stubs
    python scripts/gen_protos.py --check    # exit 1 if the checked-in stubs are stale
    python scripts/gen_protos.py --out DIR  # write the stubs into DIR instead
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

GRPCIO_TOOLS_VERSION = "1.84.0"

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
PROTO_PACKAGE_DIR = Path("loom") / "v1"
DEFAULT_OUT = REPO_ROOT / "clients" / "python" / "src" / "loom_client" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")

_ABSOLUTE_IMPORT = re.compile(r"^from loom\.v1 import ", re.MULTILINE)
_ANY_LOOM_IMPORT = re.compile(r"^\s*(?:from|import)\s+loom(?:\.|\s|$)", re.MULTILINE)


class GenerationError(RuntimeError):
    """The stubs could not be generated; the message says what to install or fix."""


def check_grpcio_tools() -> None:
    try:
        version = metadata.version("grpcio-tools")
    except metadata.PackageNotFoundError as exc:
        raise GenerationError(
            f"grpcio-tools is not installed: pip install grpcio-tools=={GRPCIO_TOOLS_VERSION}"
        ) from exc
    if version != GRPCIO_TOOLS_VERSION:
        raise GenerationError(
            f"grpcio-tools {version} is installed but the stubs must be made by {GRPCIO_TOOLS_VERSION} "
            f"(newer stubs refuse older grpcio): pip install grpcio-tools=={GRPCIO_TOOLS_VERSION}"
        )


def _plugin(name: str) -> Path:
    beside_python = Path(sys.executable).parent / name
    if beside_python.is_file():
        return beside_python
    found = shutil.which(name)
    if found is None:
        raise GenerationError(f"{name} not found: pip install mypy-protobuf")
    return Path(found)


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / PROTO_PACKAGE_DIR).glob("*.proto"))


def relativize_imports(source: str) -> str:
    """``from loom.v1 import x_pb2`` -> ``from . import x_pb2``; fail on any other loom import."""
    rewritten = _ABSOLUTE_IMPORT.sub("from . import ", source)
    leftover = _ANY_LOOM_IMPORT.search(rewritten)
    if leftover is not None:
        raise GenerationError(f"generated code still imports the loom package: {leftover.group(0).strip()!r}")
    return rewritten


def generate(out_dir: Path) -> list[Path]:
    """Generate every stub into ``out_dir`` (created if missing); returns the files written."""
    check_grpcio_tools()
    protos = proto_files()
    if not protos:
        raise GenerationError(f"no .proto files under {PROTO_ROOT / PROTO_PACKAGE_DIR}")
    with tempfile.TemporaryDirectory() as raw:
        # ``python -m grpc_tools.protoc`` adds the well-known types' include path itself.
        command = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"--proto_path={PROTO_ROOT}",
            f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
            f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
            f"--python_out={raw}",
            f"--grpc_python_out={raw}",
            f"--mypy_out={raw}",
            f"--mypy_grpc_out={raw}",
            *(str(p) for p in protos),
        ]
        # The mypy plugins print "Writing mypy to ..." on stderr: keep it unless protoc fails.
        proc = subprocess.run(command, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise GenerationError(f"protoc failed ({proc.returncode}):\n{proc.stderr}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written: list[Path] = []
        for src in sorted((Path(raw) / PROTO_PACKAGE_DIR).iterdir()):
            if not src.name.endswith(GENERATED_SUFFIXES):
                continue
            dest = out_dir / src.name
            dest.write_text(relativize_imports(src.read_text(encoding="utf-8")), encoding="utf-8")
            written.append(dest)
    return written


def stale_files(checked_in: Path) -> list[str]:
    """Names of generated files that differ from (or are missing in) ``checked_in``."""
    with tempfile.TemporaryDirectory() as fresh:
        files = generate(Path(fresh))
        return [
            f.name
            for f in files
            if not (checked_in / f.name).is_file() or not filecmp.cmp(f, checked_in / f.name, shallow=False)
        ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory to write the stubs into")
    parser.add_argument("--check", action="store_true", help="only check that --out holds up-to-date stubs")
    args = parser.parse_args(argv)
    try:
        if args.check:
            stale = stale_files(args.out)
            if stale:
                print(
                    f"stale generated stubs in {args.out}: {', '.join(stale)}; run scripts/gen_protos.py",
                    file=sys.stderr,
                )
                return 1
            print(f"generated stubs in {args.out} are up to date")
            return 0
        for path in generate(args.out):
            print(f"wrote {path}")
    except GenerationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
