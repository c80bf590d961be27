"""Small helpers for contract tests: running a cell, building expected items and WAV clips."""

from __future__ import annotations

import base64
import struct
from typing import Any

from codemode.protocol import (
    ExecuteRequest,
    ImageDetail,
    InputAudio,
    InputImage,
    InputText,
    Result,
    RuntimeResponse,
    ToolDefinition,
)
from codemode.session import (
    CodeModeSession,
)
from tests.contract.delegate import FIXTURE_TOOLS

P = "data:image/png;base64,AAA"


def img(url: str, detail: str = "high") -> InputImage:
    return InputImage(url, ImageDetail(detail))


def aud(url: str) -> InputAudio:
    return InputAudio(url)


def items(*values: Any) -> list[Any]:
    return [InputText(v) if isinstance(v, str) else v for v in values]


def wav(frames: int, rate: int = 24_000, *, declared_data: int | None = None) -> str:
    """Base64 of a PCM16 mono WAV with ``frames`` frames."""
    data = b"\x00\x00" * frames
    size = len(data) if declared_data is None else declared_data
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", size)
    riff = b"RIFF" + struct.pack("<I", len(body) + len(data)) + body + data
    return base64.b64encode(riff).decode()


def wav_url(frames: int, rate: int = 24_000, **kwargs: Any) -> str:
    return "data:audio/wav;base64," + wav(frames, rate, **kwargs)


async def start(
    session: CodeModeSession,
    source: str,
    *,
    yield_ms: int | None = 10_000,
    tools: list[ToolDefinition] | None = None,
    call_id: str = "call-1",
) -> tuple[str, RuntimeResponse]:
    """Execute a cell and await its initial response; returns the cell id and the response."""
    started = await session.execute(
        ExecuteRequest(
            tool_call_id=call_id,
            source=source,
            enabled_tools=list(FIXTURE_TOOLS if tools is None else tools),
            yield_time_ms=yield_ms,
        )
    )
    return str(started.cell_id), await started.initial_response()


async def run(session: CodeModeSession, source: str, **kwargs: Any) -> Result:
    """Execute a cell that must complete within its initial observation."""
    _, response = await start(session, source, **kwargs)
    assert isinstance(response, Result), response
    return response
