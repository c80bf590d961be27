"""The ``codemode.protocol.v1`` package: every public name resolves, and a submodule loads alone.

The package's names are looked up on first use (PEP 562): the engine imports the frame codec, a
host imports its machine, and neither should pay for the other machine and every message type.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from codemode.protocol import v1

pytestmark = pytest.mark.timeout(30)


def test_every_public_name_resolves_to_its_home_module() -> None:
    assert sorted(v1._HOMES) == sorted(v1.__all__)
    for name, home in v1._HOMES.items():
        value = getattr(v1, name)
        module = sys.modules[f"codemode.protocol.v1.{home}"]
        assert getattr(module, name) is value, name


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        v1.Nope  # noqa: B018


def test_the_codec_loads_without_the_machines() -> None:
    code = (
        "import sys, codemode.protocol.v1.codec\n"
        "print(sorted(m for m in ('codemode.protocol.v1.client', 'codemode.protocol.v1.host')"
        " if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=20, check=True
    )
    assert done.stdout.strip() == "[]"
