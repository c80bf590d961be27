"""Result rendering and output truncation (runtime.md §15.4-§15.5, cases M01-M05, X01-X10)."""

from __future__ import annotations

import base64
import math
import struct
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from codemode.model.render import (
    RenderedOutput,
    audio_token_estimate,
    count_lines,
    estimate_tokens,
    format_wall_time,
    render_outcome,
    render_response,
    truncate_items,
    truncate_middle,
    wav_duration_frames,
)
from codemode.protocol.types import (
    CellId,
    ContentItem,
    ImageDetail,
    InputAudio,
    InputImage,
    InputText,
    LiveCell,
    MissingCell,
    Result,
    Terminated,
    ToolCallSite,
    Yielded,
)

CELL = CellId("1")
P = "data:image/png;base64,AAA"
IMG = InputImage(P, ImageDetail.HIGH)


def texts(*values: str) -> list[ContentItem]:
    return [InputText(value) for value in values]


def header(status: str, seconds: str) -> InputText:
    return InputText(f"{status}\nWall time {seconds} seconds\nOutput:\n")


def warning(tokens: int, lines: int, body: str) -> InputText:
    return InputText(
        f"Warning: truncated output (original token count: {tokens})\n"
        f"Total output lines: {lines}\n\n{body}"
    )


def wav(
    frames: int, rate: int = 24_000, *, declared: int | None = None, extra: bytes = b""
) -> bytes:
    """A PCM16 mono WAV; ``declared`` overrides the data chunk's size field."""
    data = b"\x00\x00" * frames
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    size = len(data) if declared is None else declared
    body = b"WAVE" + extra + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", size) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def wav_url(frames: int) -> str:
    return "data:audio/wav;base64," + base64.b64encode(wav(frames)).decode()


# --- §15.4 rendering -------------------------------------------------------------------------


def test_m01_completed() -> None:
    rendered = render_response(Result(CELL, texts("hi")), 0.04)
    assert rendered == RenderedOutput([header("Script completed", "0.0"), InputText("hi")], True)


def test_m02_failed_appends_the_script_error() -> None:
    rendered = render_response(Result(CELL, texts("partial"), "boom"), 1.25)
    assert rendered.items == [
        header("Script failed", "1.3"),
        InputText("partial"),
        InputText("Script error:\nboom"),
    ]
    assert rendered.success is False


def test_a_failed_tool_call_s_site_follows_the_script_error() -> None:
    result = Result(CELL, [], "boom", failed_call=ToolCallSite("fail", 3, 7))
    rendered = render_response(result, 0.0)
    assert rendered.items[1:] == [
        InputText("Script error:\nboom\n    at tools.fail (exec_main.mjs:3:7)")
    ]


def test_m03_yielded() -> None:
    rendered = render_response(Yielded(CellId("7")), 10.02)
    assert rendered == RenderedOutput([header("Script running with cell ID 7", "10.0")], True)


def test_m04_terminated() -> None:
    rendered = render_response(Terminated(CELL), 0.5)
    assert rendered == RenderedOutput([header("Script terminated", "0.5")], True)


def test_m05_missing_cell() -> None:
    outcome = MissingCell(Result(CellId("9"), [], "exec cell 9 not found"))
    rendered = render_outcome(outcome, 0.0)
    assert rendered.items == [
        header("Script failed", "0.0"),
        InputText("Script error:\nexec cell 9 not found"),
    ]
    assert rendered.success is False


def test_live_cell_outcome_renders_its_response() -> None:
    rendered = render_outcome(LiveCell(Result(CELL, texts("x"))), 2.0)
    assert rendered == RenderedOutput([header("Script completed", "2.0"), InputText("x")], True)


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        (0.0, "0.0"),
        (0.04, "0.0"),
        (0.05, "0.1"),
        (0.25, "0.3"),
        (1.25, "1.3"),
        (2.35, "2.4"),
        (10.02, "10.0"),
        (59.95, "60.0"),
        (123456.78, "123456.8"),
        (-1.0, "0.0"),
        (1e28, "10000000000000000000000000000.0"),
        (1.7976931348623157e308, "17976931348623157" + "0" * 292 + ".0"),
    ],
)
def test_wall_time_rounds_halves_away_from_zero(seconds: float, expected: str) -> None:
    assert format_wall_time(seconds) == expected


@pytest.mark.parametrize("seconds", [math.inf, math.nan])
def test_a_wall_time_that_is_no_number_is_refused_by_name(seconds: float) -> None:
    with pytest.raises(ValueError, match=r"^wall time must be a finite number of seconds"):
        format_wall_time(seconds)


def test_default_budget_is_10000_tokens() -> None:
    fits = render_response(Result(CELL, texts("a" * 40_000)), 0.0)
    assert fits.items[1:] == texts("a" * 40_000)
    over = render_response(Result(CELL, texts("a" * 40_001)), 0.0)
    first = over.items[1]
    assert isinstance(first, InputText)
    assert first.text.startswith("Warning: truncated output (original token count: 10001)")


def test_content_item_json_defaults_image_detail_to_high() -> None:
    rendered = RenderedOutput(
        [InputText("t"), InputImage(P), InputImage(P, ImageDetail.LOW), InputAudio("data:a")],
        True,
    )
    assert rendered.to_json() == [
        {"type": "input_text", "text": "t"},
        {"type": "input_image", "image_url": P, "detail": "high"},
        {"type": "input_image", "image_url": P, "detail": "low"},
        {"type": "input_audio", "audio_url": "data:a"},
    ]


# --- §15.5 truncation ------------------------------------------------------------------------


def test_x01_fits() -> None:
    assert truncate_items(texts("a" * 40), 10) == texts("a" * 40)


def test_x02_single_text_over_budget() -> None:
    expected = warning(25, 1, "a" * 20 + "…15 tokens truncated…" + "a" * 20)
    assert truncate_items(texts("a" * 100), 10) == [expected]


def test_x03_texts_are_joined_with_newlines() -> None:
    expected = warning(16, 2, "x" * 20 + "…6 tokens truncated…" + "y" * 20)
    assert truncate_items(texts("x" * 30, "y" * 30), 10) == [expected]


def test_x04_zero_budget_keeps_only_the_marker() -> None:
    assert truncate_items(texts("abc"), 0) == [warning(1, 1, "…1 tokens truncated…")]


def test_x05_multibyte_characters_are_never_split() -> None:
    expected = warning(15, 1, "é" * 5 + "…10 tokens truncated…" + "é" * 5)
    assert truncate_items(texts("é" * 30), 5) == [expected]


def test_x06_error_text_is_joined_before_truncation() -> None:
    rendered = render_response(Result(CELL, texts("x" * 100), "boom"), 0.0, 10)
    body = "x" * 20 + "…20 tokens truncated…" + "x\nScript error:\nboom"
    assert rendered.items == [header("Script failed", "0.0"), warning(30, 3, body)]
    assert rendered.success is False


def test_x07_mixed_items() -> None:
    items: list[ContentItem] = [InputText("a" * 8), IMG, InputText("b" * 40), InputText("c")]
    assert truncate_items(items, 5) == [
        InputText("aaaaaaaa"),
        IMG,
        InputText("bbbbbb…7 tokens truncated…bbbbbb"),
        InputText("[omitted 1 text items ...]"),
    ]


def test_x08_mixed_items_drop_empty_text() -> None:
    assert truncate_items([InputText(""), IMG], 10) == [IMG]


def test_x09_audio_over_budget_is_omitted() -> None:
    audio = InputAudio("data:audio/mpeg;base64," + "A" * 77)
    assert len(audio.audio_url) == 100
    assert truncate_items([IMG, audio], 1) == [IMG, InputText("[omitted 1 audio items ...]")]


def test_x10_header_is_never_truncated() -> None:
    rendered = render_response(Result(CELL, texts("a" * 100)), 0.0, 1)
    assert rendered.items == [
        header("Script completed", "0.0"),
        warning(25, 1, "aa…24 tokens truncated…aa"),
    ]


def test_empty_list_is_unchanged() -> None:
    assert truncate_items([], 0) == []


def test_all_text_budget_counts_the_joining_newlines() -> None:
    assert truncate_items(texts(""), 0) == texts("")
    # Two empty items join to "\n": one byte, over a zero budget.
    assert truncate_items(texts("", ""), 0) == [warning(1, 1, "…1 tokens truncated…")]
    assert truncate_items(texts("", ""), 1) == texts("", "")


def test_mixed_omits_text_and_audio_with_text_line_first() -> None:
    audio = InputAudio("data:audio/mpeg;base64," + "A" * 77)
    items: list[ContentItem] = [InputText("a" * 8), audio, InputText("b"), IMG, InputText("c")]
    assert truncate_items(items, 2) == [
        InputText("aaaaaaaa"),
        IMG,
        InputText("[omitted 2 text items ...]"),
        InputText("[omitted 1 audio items ...]"),
    ]


def test_mixed_audio_is_charged_when_kept() -> None:
    audio = InputAudio(wav_url(24_000))  # 1 s → 10 tokens
    items: list[ContentItem] = [audio, InputText("a" * 8), InputText("b" * 4)]
    assert truncate_items(items, 12) == [
        audio,
        InputText("a" * 8),
        InputText("[omitted 1 text items ...]"),
    ]


def test_wav_audio_costs_tenths_of_seconds() -> None:
    assert audio_token_estimate(wav_url(24_000)) == 10
    assert audio_token_estimate(wav_url(2_400)) == 1
    assert audio_token_estimate(wav_url(2_401)) == 2
    assert audio_token_estimate(wav_url(0)) == 0


def test_non_wav_audio_costs_its_url_size() -> None:
    url = "data:audio/mpeg;base64," + base64.b64encode(b"ID3" + bytes(40)).decode()
    assert audio_token_estimate(url) == math.ceil(len(url) / 4)
    broken = "data:audio/wav;base64,@@@@"
    assert audio_token_estimate(broken) == math.ceil(len(broken) / 4)


def test_wav_duration_rules() -> None:
    assert wav_duration_frames(wav(100)) == (100, 24_000)
    # The declared data size is capped by the bytes actually present.
    assert wav_duration_frames(wav(100, declared=10_000)) == (100, 24_000)
    # Unknown chunks (odd sizes are padded) are skipped.
    odd_chunk = b"LIST" + struct.pack("<I", 3) + b"abc" + b"\x00"
    assert wav_duration_frames(wav(50, extra=odd_chunk)) == (50, 24_000)
    assert wav_duration_frames(wav(10, rate=0)) is None
    assert wav_duration_frames(b"RIFF\x00\x00\x00\x00WAVE") is None
    assert wav_duration_frames(b"not a wav file at all") is None


@pytest.mark.parametrize(
    ("text", "lines"),
    [("", 0), ("a", 1), ("a\n", 1), ("a\nb\n", 2), ("a\nb", 2), ("\n", 1), ("a\r\nb", 2)],
)
def test_count_lines(text: str, lines: int) -> None:
    assert count_lines(text) == lines


@pytest.mark.parametrize(
    ("text", "tokens"), [("", 0), ("a", 1), ("abcd", 1), ("abcde", 2), ("é", 1), ("😀😀", 2)]
)
def test_estimate_tokens(text: str, tokens: int) -> None:
    assert estimate_tokens(text) == tokens


def test_truncate_middle_drops_characters_straddling_either_cut() -> None:
    # 4-byte emoji: B = 12, L = 6 → one whole emoji (4 bytes) fits the head; the tail starts at
    # byte 34 of 40, inside the ninth emoji, so only the tenth survives.
    assert truncate_middle("😀" * 10, 3) == "😀…7 tokens truncated…😀"


def test_truncate_middle_edges() -> None:
    assert truncate_middle("", 0) == ""
    assert truncate_middle("", 5) == ""
    assert truncate_middle("abcd", 1) == "abcd"
    assert truncate_middle("abcde", 1) == "ab…1 tokens truncated…de"


def test_one_megabyte_under_the_default_budget() -> None:
    lines = [f"line {index:06}: {'payload ' * 10}" for index in range(12_000)]
    output = "\n".join(lines)
    size = len(output)
    assert size > 1_000_000
    rendered = render_response(Result(CELL, [InputText(output)]), 3.14159, 10_000)
    expected_body = (
        output[:20_000]
        + f"…{math.ceil((size - 40_000) / 4)} tokens truncated…"
        + output[size - 20_000 :]
    )
    assert rendered.items == [
        header("Script completed", "3.1"),
        warning(math.ceil(size / 4), 12_000, expected_body),
    ]


def test_one_megabyte_of_multibyte_text_under_the_default_budget() -> None:
    # 1 000 004 bytes; both cuts (bytes 20 000 and 980 004) fall inside an é, which is dropped.
    output = "abc" + "é" * 500_000 + "z"
    (item,) = truncate_items([InputText(output)], 10_000)
    assert isinstance(item, InputText)
    assert item.text.startswith("Warning: truncated output (original token count: 250001)\n")
    body = item.text.split("\n\n", 1)[1]
    assert body == "abc" + "é" * 9_998 + "…240001 tokens truncated…" + "é" * 9_999 + "z"


@pytest.mark.slow
@pytest.mark.parametrize("character", ["x", "é"])
def test_sixty_four_megabytes_truncate_quickly(character: str) -> None:
    output = character * (64 * 1024 * 1024 // len(character.encode()))
    started = time.perf_counter()
    rendered = render_response(Result(CELL, [InputText(output), InputText("end")]), 0.0)
    elapsed = time.perf_counter() - started
    last = rendered.items[-1]
    assert isinstance(last, InputText)
    assert last.text.endswith(character + "\nend")
    assert elapsed < 2.0, f"truncating 64 MB took {elapsed:.2f} s"


def reference_truncate_middle(text: str, max_tokens: int) -> str:
    """§15.5 `mid`, written the slow and obvious way: walk characters with byte offsets."""
    data = text.encode("utf-8", "surrogatepass")
    if not text:
        return ""
    if max_tokens == 0:
        return f"…{math.ceil(len(data) / 4)} tokens truncated…"
    budget = 4 * max_tokens
    if len(data) <= budget:
        return text
    head, tail = budget // 2, budget - budget // 2
    prefix, suffix, offset = [], [], 0
    for character in text:
        width = len(character.encode("utf-8", "surrogatepass"))
        if offset + width <= head:
            prefix.append(character)
        if offset >= len(data) - tail:
            suffix.append(character)
        offset += width
    removed = math.ceil((len(data) - budget) / 4)
    return "".join(prefix) + f"…{removed} tokens truncated…" + "".join(suffix)


@given(
    text=st.text(alphabet=st.characters(codec="utf-8"), max_size=200)
    | st.text(alphabet="aé€😀\n", max_size=200),
    max_tokens=st.integers(min_value=0, max_value=60),
)
def test_truncate_middle_matches_the_reference(text: str, max_tokens: int) -> None:
    assert truncate_middle(text, max_tokens) == reference_truncate_middle(text, max_tokens)
