"""Regenerate the committed gRPC code from ``codex/code_mode/v1.proto`` (docs/decisions/0009).

Usage (from the checkout root, in the venv with the ``test`` extra installed)::

    .venv/bin/python scripts/generate_grpc.py                  # rewrite the committed files
    .venv/bin/python scripts/generate_grpc.py --check          # exit 1 if they are out of date
    .venv/bin/python scripts/generate_grpc.py --output-root D  # write the same tree under D

The output is a pure function of the ``.proto`` and of the two pinned generators below: protoc and
the gRPC plugin of ``grpcio-tools`` (``v1_pb2.py``, ``v1_pb2_grpc.py``) and ``mypy-protobuf``
(``v1_pb2.pyi``, ``v1_pb2_grpc.pyi``). Each generated file then gets a fixed set of textual
rewrites so that it imports, and names its classes, as a module of the installed package
(``codemode.protocol.grpc.v1_pb2``) instead of as ``codex.code_mode.v1_pb2``; every rewrite must
match exactly once, so a generator whose output changed shape fails here instead of producing
something subtly different. ``tests/protocol/grpc/test_stubs.py`` runs this script into a
temporary directory and compares byte for byte.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import sysconfig
import tempfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The ``-I`` root: the proto keeps its conventional path, so descriptors name ``codex/code_mode/v1.proto``.
PROTO_ROOT = Path("src/codemode/protocol/grpc")
PROTO = "codex/code_mode/v1.proto"

#: Generators whose exact version the committed output depends on.
PINNED = {"grpcio-tools": "1.85.1", "mypy-protobuf": "5.1.0"}

#: Generated file (relative to protoc's output directory) → where it is committed.
OUTPUTS = {
    "codex/code_mode/v1_pb2.py": "src/codemode/protocol/grpc/v1_pb2.py",
    "codex/code_mode/v1_pb2.pyi": "src/codemode/protocol/grpc/v1_pb2.pyi",
    "codex/code_mode/v1_pb2_grpc.py": "src/codemode/grpc_stubs/v1_pb2_grpc.py",
    "codex/code_mode/v1_pb2_grpc.pyi": "src/codemode/grpc_stubs/v1_pb2_grpc.pyi",
}

_MESSAGES_IMPORT = "from codemode.protocol.grpc import v1_pb2 as"

#: Generated file → (old, new) replacements, each of which must occur exactly once.
REWRITES = {
    "codex/code_mode/v1_pb2.py": [
        # The module name the message classes report (``__module__``, pickling, reprs).
        (
            "BuildTopDescriptorsAndMessages(DESCRIPTOR, 'codex.code_mode.v1_pb2', _globals)",
            "BuildTopDescriptorsAndMessages(DESCRIPTOR, 'codemode.protocol.grpc.v1_pb2', _globals)",
        ),
    ],
    "codex/code_mode/v1_pb2.pyi": [],
    "codex/code_mode/v1_pb2_grpc.py": [
        ("from codex.code_mode import v1_pb2 as", _MESSAGES_IMPORT),
    ],
    "codex/code_mode/v1_pb2_grpc.pyi": [
        ("from codex.code_mode import v1_pb2 as", _MESSAGES_IMPORT),
    ],
}


class GenerationError(Exception):
    """The generators are missing, of the wrong version, or produced something unexpected."""


def check_versions() -> None:
    """Refuse to run with generators other than the pinned ones (the output would differ)."""
    for package, wanted in PINNED.items():
        try:
            found = metadata.version(package)
        except metadata.PackageNotFoundError:
            raise GenerationError(
                f"{package} is not installed; install the test extra: pip install -e '.[test]'"
            ) from None
        if found != wanted:
            raise GenerationError(
                f"{package} {found} is installed but the committed stubs were generated with "
                f"{package}=={wanted}; install that version (or bump the pin in pyproject.toml, "
                "here, and in docs/decisions/0009-grpc-interface.md, then regenerate)"
            )


def _plugin(name: str) -> str:
    scripts = Path(sysconfig.get_path("scripts"))
    for candidate in (scripts / name, scripts / f"{name}.exe"):
        if candidate.exists():
            return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise GenerationError(f"{name} not found (it comes with mypy-protobuf)")
    return found


def _rewrite(name: str, text: str) -> str:
    for old, new in REWRITES[name]:
        count = text.count(old)
        if count != 1:
            raise GenerationError(f"{name}: expected {old!r} once, found it {count} times")
        text = text.replace(old, new)
    return text


def generate() -> dict[str, bytes]:
    """Run the generators; return each committed path (relative to the root) → its content."""
    check_versions()
    from grpc_tools import protoc  # type: ignore[import-untyped]  # the pin was checked above

    with tempfile.TemporaryDirectory() as scratch:
        args = [
            "grpc_tools.protoc",
            f"--proto_path={ROOT / PROTO_ROOT}",
            f"--python_out={scratch}",
            f"--grpc_python_out={scratch}",
            f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
            f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
            f"--mypy_out=quiet:{scratch}",
            f"--mypy_grpc_out=quiet:{scratch}",
            PROTO,
        ]
        status = protoc.main(args)
        if status != 0:
            raise GenerationError(f"protoc failed with status {status}")
        produced = {
            path.relative_to(scratch).as_posix()
            for path in Path(scratch).rglob("*")
            if path.is_file()
        }
        if produced != set(OUTPUTS):
            raise GenerationError(f"protoc produced {sorted(produced)}, expected {sorted(OUTPUTS)}")
        result: dict[str, bytes] = {}
        for name, target in OUTPUTS.items():
            text = (Path(scratch) / name).read_text(encoding="utf-8")
            result[target] = _rewrite(name, text).encode("utf-8")
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-root", type=Path, default=ROOT, help="write the tree here")
    parser.add_argument(
        "--check", action="store_true", help="compare with the files under the root instead"
    )
    options = parser.parse_args(argv)
    try:
        files = generate()
    except GenerationError as error:
        print(f"generate_grpc: {error}", file=sys.stderr)
        return 2
    stale = []
    for relative, content in files.items():
        path = options.output_root / relative
        if options.check:
            if not path.exists() or path.read_bytes() != content:
                stale.append(relative)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_bytes() != content:
            path.write_bytes(content)
            print(f"wrote {relative}")
    if stale:
        print(
            "generate_grpc: out of date (run scripts/generate_grpc.py): " + ", ".join(stale),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
