"""Frame codec throughput beside raw JSON decoding of the same bytes, measured in the same run.

Run: ``python -m benchmarks.codec`` (or ``python benchmarks/codec.py``).

Payloads: a small and a medium frame, a 16 MiB tool result of one long string, and a tool result of
250,000 small rows (a million values: the decoder's cost per value). For each: typed decode+validate through :class:`MessageDecoder` and a full
:class:`FrameDecoder` pass, and encode+frame through :func:`encode_frame`, beside the baselines
``msgspec.json.decode`` (untyped) and ``json.loads`` of the same payload bytes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import msgspec

from codemode.protocol.v1 import FrameDecoder, MessageDecoder, encode_frame, encode_payload
from codemode.protocol.v1.messages import ClientToHost, HostToClient

_RAW = msgspec.json.Decoder()


def _small() -> tuple[str, bytes, MessageDecoder[Any]]:
    message = {
        "type": "delegate/request",
        "id": 1,
        "sessionId": "session-1",
        "request": {
            "type": "tool/invoke",
            "invocation": {
                "cell_id": "1",
                "runtime_tool_call_id": "tool-1",
                "tool_name": {"name": "echo", "namespace": None},
                "tool_kind": "function",
                "input": {"value": "ping"},
            },
        },
    }
    return "small delegate/request", json.dumps(message).encode(), MessageDecoder(HostToClient)


def _medium() -> tuple[str, bytes, MessageDecoder[Any]]:
    tools = [
        {
            "name": f"mcp__server__tool_{i}",
            "tool_name": {"name": f"tool_{i}", "namespace": "mcp__server__"},
            "description": f"Tool number {i}: does something useful with its arguments.",
            "kind": "function",
            "input_schema": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "what to look for"},
                    "limit": {"type": "integer", "minimum": 1, "maximum": 100},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["query"],
                "additionalProperties": False,
            },
            "output_schema": None,
        }
        for i in range(50)
    ]
    message = {
        "type": "operation/request",
        "id": 2,
        "request": {
            "method": "session/execute",
            "sessionId": "session-1",
            "request": {
                "tool_call_id": "call-1",
                "enabled_tools": tools,
                "source": "const r = await tools.tool_1({query: 'x'}); text(r);",
                "yield_time_ms": 10000,
                "max_output_tokens": 10000,
            },
        },
    }
    return "execute, 50 tools", json.dumps(message).encode(), MessageDecoder(ClientToHost)


def _large() -> tuple[str, bytes, MessageDecoder[Any]]:
    line = "line of tool output: value=42, ok; " * 3 + "\n"
    text = (line * (16 * 1024 * 1024 // len(line) + 1))[: 16 * 1024 * 1024 - 200]
    message = {
        "type": "delegate/response",
        "id": 9,
        "result": {"status": "ok", "value": {"type": "tool/result", "result": {"text": text}}},
    }
    return "16 MiB tool result", json.dumps(message).encode(), MessageDecoder(ClientToHost)


def _many_values() -> tuple[str, bytes, MessageDecoder[Any]]:
    rows = [{"id": i, "name": "x", "tags": [], "score": 1.5} for i in range(250_000)]
    message = {
        "type": "delegate/response",
        "id": 9,
        "result": {"status": "ok", "value": {"type": "tool/result", "result": rows}},
    }
    return "250k-row tool result", json.dumps(message).encode(), MessageDecoder(ClientToHost)


def _rate(function: Callable[[], object], budget: float) -> float:
    """Calls per second of ``function``, best of several rounds within ``budget`` seconds."""
    function()
    start = time.perf_counter()
    calls = 0
    while time.perf_counter() - start < budget / 10:
        function()
        calls += 1
    per_round = max(1, calls)
    best = float("inf")
    deadline = time.perf_counter() + budget
    while time.perf_counter() < deadline:
        began = time.perf_counter()
        for _ in range(per_round):
            function()
        best = min(best, (time.perf_counter() - began) / per_round)
    return 1.0 / best


def _frame_pass(frame: bytes, decoder: MessageDecoder[Any]) -> Callable[[], object]:
    def run() -> object:
        reader: FrameDecoder[Any] = FrameDecoder(decoder)
        reader.receive_data(frame)
        return reader.next_message()

    return run


def main(budget: float = 1.0) -> None:
    """Print the codec table."""
    rows: list[tuple[str, str, float, int]] = []
    for name, payload, decoder in (_small(), _medium(), _large(), _many_values()):
        size = len(payload)
        message = decoder.decode(payload)
        frame = bytes(encode_frame(message))
        raw = _rate(lambda p=payload: _RAW.decode(p), budget)  # type: ignore[misc]
        stdlib = _rate(lambda p=payload: json.loads(p), budget)  # type: ignore[misc]
        typed = _rate(lambda p=payload, d=decoder: d.decode(p), budget)  # type: ignore[misc]
        framed = _rate(_frame_pass(frame, decoder), budget)
        encode = _rate(lambda m=message: encode_frame(m), budget)  # type: ignore[misc]
        raw_encode = _rate(lambda m=message: encode_payload(m), budget)  # type: ignore[misc]
        rows.append((name, "raw msgspec.json.decode (baseline)", raw, size))
        rows.append((name, "json.loads", stdlib, size))
        rows.append((name, "typed decode+validate", typed, size))
        rows.append((name, "FrameDecoder (prefix+decode)", framed, size))
        rows.append((name, "encode payload only", raw_encode, size))
        rows.append((name, "encode+frame", encode, size))
    print(f"{'payload':<24}{'operation':<38}{'msgs/s':>12}{'MB/s':>10}{'vs baseline':>13}")
    baseline = 1.0
    for name, operation, rate, size in rows:
        if "baseline" in operation:
            baseline = rate
        ratio = rate / baseline
        print(f"{name:<24}{operation:<38}{rate:>12,.0f}{rate * size / 1e6:>10,.0f}{ratio:>12.2f}x")
    print("\n'vs baseline' > 1 is faster than raw untyped decoding of the same bytes;")
    print(
        "cost ratio = 1 / that figure (goal: small typed decode <= 1.3x cost; 16 MiB >= 0.8x speed)."
    )


if __name__ == "__main__":
    main()
