"""Loading the conformance vectors copied from the specification's ``vectors/`` folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent


def load(name: str) -> list[dict[str, Any]]:
    """The entries of one vector file."""
    with (HERE / name).open(encoding="ascii") as file:
        entries: list[dict[str, Any]] = json.load(file)
    return entries


def params(name: str, **filters: Any) -> list[Any]:
    """pytest parameters for the entries of one file, with ids from their names."""
    return [
        pytest.param(entry, id=entry["name"])
        for entry in load(name)
        if all(entry.get(key) == value for key, value in filters.items())
    ]


def canonical(value: Any) -> bytes:
    """The byte form the encoder must produce for an expected value."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
