"""Host and provider options are checked when they are made: a wrong value is a ValueError that
names the option (they were taken as given, and failed later or never, e.g. a NaN keepalive)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import pytest

from codemode.host import HostOptions
from codemode.host.address import WebSocketAddress
from codemode.host.websocket import WebSocketHost
from codemode.protocol.options import checked_count, checked_seconds
from codemode.runtime import LocalSessionProvider

grpc_host = pytest.importorskip("codemode.host.grpc")

COUNTS: dict[str, Callable[..., object]] = {
    "HostOptions.max_in_flight_requests": lambda v: HostOptions(max_in_flight_requests=v),
    "HostOptions.max_active_cells": lambda v: HostOptions(max_active_cells=v),
    "GrpcHostOptions.max_active_cells": lambda v: grpc_host.GrpcHostOptions(max_active_cells=v),
    "GrpcHostOptions.max_in_flight_requests": lambda v: grpc_host.GrpcHostOptions(
        max_in_flight_requests=v
    ),
    "GrpcHostOptions.max_sessions": lambda v: grpc_host.GrpcHostOptions(max_sessions=v),
    "WebSocketHost.max_connections": lambda v: WebSocketHost(
        LocalSessionProvider(), WebSocketAddress("127.0.0.1", 0), max_connections=v
    ),
    "LocalSessionProvider.max_engines": lambda v: LocalSessionProvider(max_engines=v),
    "LocalSessionProvider.memory_cap_bytes": lambda v: LocalSessionProvider(memory_cap_bytes=v),
    "LocalSessionProvider.max_held_chars": lambda v: LocalSessionProvider(max_held_chars=v),
    "LocalSessionProvider.total_memory_cap_bytes": lambda v: LocalSessionProvider(
        total_memory_cap_bytes=v
    ),
}

SECONDS: dict[str, tuple[Callable[..., object], bool]] = {
    "GrpcHostOptions.keepalive_time": (lambda v: grpc_host.GrpcHostOptions(keepalive_time=v), True),
    "GrpcHostOptions.keepalive_timeout": (
        lambda v: grpc_host.GrpcHostOptions(keepalive_timeout=v),
        False,
    ),
    "GrpcHostOptions.min_client_ping_interval": (
        lambda v: grpc_host.GrpcHostOptions(min_client_ping_interval=v),
        True,
    ),
    "GrpcHostOptions.session_shutdown_timeout": (
        lambda v: grpc_host.GrpcHostOptions(session_shutdown_timeout=v),
        True,
    ),
    "WebSocketHost.ping_interval": (
        lambda v: WebSocketHost(
            LocalSessionProvider(), WebSocketAddress("127.0.0.1", 0), ping_interval=v
        ),
        False,
    ),
    "WebSocketHost.ping_timeout": (
        lambda v: WebSocketHost(
            LocalSessionProvider(), WebSocketAddress("127.0.0.1", 0), ping_timeout=v
        ),
        False,
    ),
    "LocalSessionProvider.idle_engine_timeout": (
        lambda v: LocalSessionProvider(idle_engine_timeout=v),
        True,
    ),
}


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "2"])
@pytest.mark.parametrize("where", COUNTS)
def test_counts_are_integers_of_at_least_one(where: str, value: Any) -> None:
    name = where.partition(".")[2]
    expected = f"{name} must be an integer of at least 1, not {value!r}"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        COUNTS[where](value)
    assert COUNTS[where](3) is not None


@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf, -math.inf, True, "5"])
@pytest.mark.parametrize("where", SECONDS)
def test_durations_are_finite_seconds(where: str, value: Any) -> None:
    make, zero = SECONDS[where]
    name = where.partition(".")[2]
    least = "a non-negative" if zero else "a positive"
    expected = f"{name} must be {least} finite number of seconds, not {value!r}"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        make(value)
    assert make(2.5) is not None


@pytest.mark.parametrize("where", SECONDS)
def test_zero_seconds_means_what_the_option_says(where: str) -> None:
    make, zero = SECONDS[where]
    if zero:
        assert make(0) is not None
    else:
        with pytest.raises(ValueError, match="must be a positive finite number of seconds"):
            make(0)


def test_warm_engines_may_be_zero() -> None:
    assert LocalSessionProvider(warm_engines=0).pool.size == 0
    with pytest.raises(
        ValueError, match=r"^warm_engines must be an integer of at least 0, not -1$"
    ):
        LocalSessionProvider(warm_engines=-1)


def test_the_checks_themselves() -> None:
    assert checked_seconds("t", 1) == 1.0
    assert isinstance(checked_seconds("t", 1), float)
    assert checked_seconds("t", 0, zero=True) == 0.0
    assert checked_count("n", 0, minimum=0) == 0
    with pytest.raises(ValueError, match=r"^n must be an integer of at least 2, not 1$"):
        checked_count("n", 1, minimum=2)
