"""Rendering runtime outcomes for the model, with output truncation (``runtime.md`` §15.4-§15.5).

Outputs can be tens of megabytes, so nothing here walks a string character by character: byte
lengths come from one encode, and cuts are slices adjusted to UTF-8 character boundaries.
"""

from __future__ import annotations

import base64
import binascii
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Context, Decimal
from typing import Final

from codemode.protocol.constants import DEFAULT_MAX_OUTPUT_TOKENS_PER_EXEC_CALL
from codemode.protocol.types import (
    JSON,
    ContentItem,
    ImageDetail,
    InputAudio,
    InputImage,
    InputText,
    MissingCell,
    Result,
    RuntimeResponse,
    Terminated,
    WaitOutcome,
    Yielded,
)

__all__ = [
    "DEFAULT_IMAGE_DETAIL",
    "RenderedOutput",
    "audio_token_estimate",
    "count_lines",
    "estimate_tokens",
    "format_wall_time",
    "render_outcome",
    "render_response",
    "truncate_items",
    "truncate_middle",
    "wav_duration_frames",
]

DEFAULT_IMAGE_DETAIL: Final = ImageDetail.HIGH
_BYTES_PER_TOKEN: Final = 4
_ONE_DECIMAL: Final = Decimal("0.1")
_WALL_TIME_DIGITS: Final = 320  # the largest double has 309 digits before the point
#: The most RIFF chunks read to find a WAV clip's ``fmt `` and ``data`` chunks (a real file has a
#: handful). Each costs a step of Python: a cell's 12 MB clip of 8-byte chunks held the event loop
#: of the agent that rendered it for 0.9 s. A clip with more is not measurable (its URL counts).
MAX_WAV_CHUNKS: Final = 1024


@dataclass(frozen=True, slots=True)
class RenderedOutput:
    """What an ``exec``/``wait`` call returns to the model: content items and a success flag."""

    items: list[ContentItem]
    success: bool

    def to_json(self) -> list[dict[str, JSON]]:
        """The items as Responses API ``function_call_output`` content (image detail filled in)."""
        return [content_item_json(item) for item in self.items]


def content_item_json(item: ContentItem) -> dict[str, JSON]:
    """One content item in its model-facing JSON shape; images default to ``high`` detail."""
    if isinstance(item, InputText):
        return {"type": "input_text", "text": item.text}
    if isinstance(item, InputImage):
        detail = item.detail or DEFAULT_IMAGE_DETAIL
        return {"type": "input_image", "image_url": item.image_url, "detail": detail.value}
    return {"type": "input_audio", "audio_url": item.audio_url}


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _byte_len(text: str) -> int:
    # isascii() is a fast scan; only non-ASCII text pays for an encode.
    return len(text) if text.isascii() else len(_utf8(text))


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def estimate_tokens(text: str) -> int:
    """``ceil(utf8_bytes / 4)``."""
    return _ceil_div(_byte_len(text), _BYTES_PER_TOKEN)


def count_lines(text: str) -> int:
    """Lines separated by ``\\n``; a trailing ``\\n`` does not start another line."""
    if not text:
        return 0
    return text.count("\n") + (0 if text.endswith("\n") else 1)


def _marker(tokens: int) -> str:
    return f"\u2026{tokens} tokens truncated\u2026"


def truncate_middle(text: str, max_tokens: int) -> str:
    """Keep the start and end of ``text`` within ``max_tokens``, with a marker in between."""
    return _truncate_middle(text, _byte_len(text), max_tokens)


def _truncate_middle(text: str, size: int, max_tokens: int) -> str:
    """:func:`truncate_middle` for a ``text`` whose UTF-8 size is already known."""
    if not text:
        return ""
    if max_tokens <= 0:
        return _marker(_ceil_div(size, _BYTES_PER_TOKEN))
    budget = max_tokens * _BYTES_PER_TOKEN
    if size <= budget:
        return text
    head = budget // 2
    tail = budget - head
    marker = _marker(_ceil_div(size - budget, _BYTES_PER_TOKEN))
    if size == len(text):  # ASCII: bytes are characters
        return text[:head] + marker + text[size - tail :]
    # n characters encode to at least n bytes, so encoding the first `head` and the last `tail`
    # characters is enough to find both cuts without encoding the whole text.
    start = _utf8(text[:head])[:head]
    end = _utf8(text[-tail:])[-tail:]
    # Drop a character straddling a cut: the head ends before it, the tail starts after it.
    cut = _whole_characters(start)
    skip = 0
    while skip < len(end) and end[skip] & 0xC0 == 0x80:
        skip += 1
    return (
        start[:cut].decode("utf-8", "surrogatepass")
        + marker
        + end[skip:].decode("utf-8", "surrogatepass")
    )


def _whole_characters(data: bytes) -> int:
    """Length of the longest prefix of UTF-8 ``data`` that ends on a character boundary."""
    lead = len(data) - 1
    while lead >= 0 and data[lead] & 0xC0 == 0x80:
        lead -= 1
    if lead < 0:
        return 0
    first = data[lead]
    width = 1 if first < 0x80 else 2 if first < 0xE0 else 3 if first < 0xF0 else 4
    return len(data) if lead + width <= len(data) else lead


def _truncate_all_text(items: Sequence[InputText], max_tokens: int) -> list[ContentItem]:
    joined = "\n".join(item.text for item in items)
    size = _byte_len(joined)
    if size <= max_tokens * _BYTES_PER_TOKEN:
        return list(items)
    header = (
        f"Warning: truncated output (original token count: "
        f"{_ceil_div(size, _BYTES_PER_TOKEN)})\nTotal output lines: {count_lines(joined)}\n\n"
    )
    return [InputText(header + _truncate_middle(joined, size, max_tokens))]


def wav_duration_frames(data: bytes) -> tuple[int, int] | None:
    """``(frames, sample_rate)`` of a RIFF/WAVE file, or ``None`` when not measurable (§5.5)."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    offset = 12
    sample_rate = block_align = None
    usable = None
    chunks = 0
    # Nothing a later chunk holds changes the outcome once both are found.
    while offset + 8 <= len(data) and (sample_rate is None or usable is None):
        chunks += 1
        if chunks > MAX_WAV_CHUNKS:
            return None
        chunk_id = data[offset : offset + 4]
        (chunk_size,) = struct.unpack_from("<I", data, offset + 4)
        body = offset + 8
        if chunk_id == b"fmt " and sample_rate is None:
            if body + 14 > len(data):
                return None
            (sample_rate,) = struct.unpack_from("<I", data, body + 4)
            (block_align,) = struct.unpack_from("<H", data, body + 12)
        elif chunk_id == b"data" and usable is None:
            usable = min(chunk_size, len(data) - body)
        offset = body + chunk_size + (chunk_size & 1)
    if not sample_rate or not block_align or usable is None:
        return None
    return usable // block_align, sample_rate


def _data_url_payload(url: str) -> bytes | None:
    """The decoded payload of a base64 ``data:`` URL, else ``None``."""
    scheme, colon, rest = url.partition(":")
    if not colon or scheme.lower() != "data":
        return None
    header, comma, payload = rest.partition(",")
    if not comma or not header.lower().endswith(";base64"):
        return None
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        return None


def audio_token_estimate(audio_url: str) -> int:
    """Tokens an audio item costs: ``ceil(seconds * 10)`` for a measurable WAV, else URL size."""
    payload = _data_url_payload(audio_url)
    measured = wav_duration_frames(payload) if payload is not None else None
    if measured is None:
        return estimate_tokens(audio_url)
    frames, sample_rate = measured
    return _ceil_div(frames * 10, sample_rate)


def _truncate_mixed(items: Sequence[ContentItem], max_tokens: int) -> list[ContentItem]:
    remaining = max_tokens
    kept: list[ContentItem] = []
    omitted_text = omitted_audio = 0
    for item in items:
        if isinstance(item, InputImage):
            kept.append(item)
        elif isinstance(item, InputAudio):
            cost = audio_token_estimate(item.audio_url)
            if cost <= remaining:
                kept.append(item)
                remaining -= cost
            else:
                omitted_audio += 1
        elif not item.text:
            continue
        elif remaining == 0:
            omitted_text += 1
        else:
            size = _byte_len(item.text)
            cost = _ceil_div(size, _BYTES_PER_TOKEN)
            if cost <= remaining:
                kept.append(item)
                remaining -= cost
            else:
                shortened = _truncate_middle(item.text, size, remaining)
                remaining = 0
                if shortened:
                    kept.append(InputText(shortened))
                else:
                    omitted_text += 1
    if omitted_text:
        kept.append(InputText(f"[omitted {omitted_text} text items ...]"))
    if omitted_audio:
        kept.append(InputText(f"[omitted {omitted_audio} audio items ...]"))
    return kept


def truncate_items(items: Sequence[ContentItem], max_tokens: int) -> list[ContentItem]:
    """Fit ``items`` into ``max_tokens`` (§15.5): all-text lists collapse to one warning item."""
    max_tokens = max(0, max_tokens)
    texts = [item for item in items if isinstance(item, InputText)]
    if len(texts) == len(items):
        return _truncate_all_text(texts, max_tokens)
    return _truncate_mixed(items, max_tokens)


def format_wall_time(seconds: float) -> str:
    """Seconds with one decimal, halves rounded away from zero (``1.25`` → ``1.3``)."""
    # repr() gives the shortest decimal that round-trips, i.e. the number as the caller wrote it.
    seconds = float(seconds)
    if not math.isfinite(seconds):
        raise ValueError(f"wall time must be a finite number of seconds, not {seconds!r}")
    seconds = max(0.0, seconds)
    # Exact for any double: quantize needs a precision of all the digits before the point.
    exact = Context(prec=_WALL_TIME_DIGITS)
    return str(Decimal(repr(seconds)).quantize(_ONE_DECIMAL, ROUND_HALF_UP, exact))


def _status(response: RuntimeResponse) -> tuple[str, bool]:
    if isinstance(response, Yielded):
        return f"Script running with cell ID {response.cell_id}", True
    if isinstance(response, Terminated):
        return "Script terminated", True
    if response.error_text is None:
        return "Script completed", True
    return "Script failed", False


def _call_site(result: Result) -> str:
    # After the spec's text, so the error still starts as §15.4 says: the cell line whose tool
    # call failed, in the form of the stack frames a model already reads in error texts.
    site = result.failed_call
    if site is None:
        return ""
    return f"\n    at tools.{site.tool} (exec_main.mjs:{site.line}:{site.column})"


def render_response(
    response: RuntimeResponse, wall_time_seconds: float, max_tokens: int | None = None
) -> RenderedOutput:
    """Header, the truncated items and ``Script error:`` text of one outcome (§15.4)."""
    budget = DEFAULT_MAX_OUTPUT_TOKENS_PER_EXEC_CALL if max_tokens is None else max_tokens
    items: list[ContentItem] = list(response.content_items)
    if isinstance(response, Result) and response.error_text is not None:
        items.append(InputText(f"Script error:\n{response.error_text}{_call_site(response)}"))
    status, success = _status(response)
    header = InputText(
        f"{status}\nWall time {format_wall_time(wall_time_seconds)} seconds\nOutput:\n"
    )
    return RenderedOutput([header, *truncate_items(items, budget)], success)


def render_outcome(
    outcome: WaitOutcome, wall_time_seconds: float, max_tokens: int | None = None
) -> RenderedOutput:
    """Render a ``wait``/``terminate`` outcome; a missing cell renders as its failed result."""
    rendered = render_response(outcome.response, wall_time_seconds, max_tokens)
    if isinstance(outcome, MissingCell):
        return RenderedOutput(rendered.items, False)
    return rendered
