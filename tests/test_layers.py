"""The layering the architecture promises, checked on the source: ``protocol/`` does no I/O, and
the V1 glue (``host/``, ``client/``) leaves every protocol decision to the machines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "codemode"

#: Modules that would mean I/O, threads or an event loop.
IO_MODULES = {"asyncio", "socket", "subprocess", "threading", "selectors", "os", "signal", "grpc"}
#: What the glue must not reach into: wire structs, framing, lanes, or texts to format.
WIRE_MODULES = {
    "codemode.protocol.v1.messages",
    "codemode.protocol.v1.codec",
    "codemode.protocol.v1.lanes",
    "codemode.protocol.v1.conversions",
}


def imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            found.add(node.module)
    return found


@pytest.mark.parametrize(
    "path", sorted((SRC / "protocol").rglob("*.py")), ids=lambda p: str(p.relative_to(SRC))
)
def test_protocol_does_no_io_and_imports_nothing_above_it(path: Path) -> None:
    for module in imports(path):
        assert module.split(".")[0] not in IO_MODULES, f"{path.name} imports {module}"
        if module.startswith("codemode."):
            assert module.startswith("codemode.protocol") or module == "codemode.errors", (
                f"{path.name} imports {module} from a layer above protocol/"
            )


@pytest.mark.parametrize(
    "path",
    sorted([*(SRC / "host").rglob("*.py"), *(SRC / "client").rglob("*.py")]),
    ids=lambda p: str(p.relative_to(SRC)),
)
def test_the_v1_glue_uses_only_the_machines(path: Path) -> None:
    reached = imports(path) & WIRE_MODULES
    assert not reached, f"{path.name} reaches past the machines into {sorted(reached)}"
