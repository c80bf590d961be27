"""``lanes.json`` and ``bulk-url.json``: the lane of every message family; bulk URL derivation."""

from __future__ import annotations

import json
from typing import Any

import pytest

from codemode.protocol.v1 import WIRE_TYPES, Lane, MessageDecoder, allows_lane, bulk_url, lane_of
from tests.conformance.vectors import params

DIRECTIONS = {
    "client_to_host": MessageDecoder[Any](WIRE_TYPES["ClientToHost"]),
    "host_to_client": MessageDecoder[Any](WIRE_TYPES["HostToClient"]),
}


@pytest.mark.parametrize("entry", params("lanes.json"))
def test_lane(entry: dict[str, Any]) -> None:
    message = DIRECTIONS[entry["direction"]].decode(json.dumps(entry["json"]).encode())
    lane = Lane(entry["lane"])
    other = Lane.BULK if lane is Lane.CONTROL else Lane.CONTROL
    assert lane_of(message) is lane
    assert allows_lane(message, lane)
    assert not allows_lane(message, other)


@pytest.mark.parametrize("entry", params("bulk-url.json"))
def test_bulk_url(entry: dict[str, Any]) -> None:
    assert bulk_url(entry["control_url"], entry["token"]) == entry["bulk_url"]
