"""The model-facing layer against hostile cells, model calls and tool definitions or outputs.

Each case was found by a sweep of the layer above the engine: the agent's Python process must not
exit, hang or raise an unexpected exception type, and the model must get a clear error instead.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import struct
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from codemode.errors import CodeModeError
from codemode.model import CodeMode, ToolRegistry, render
from codemode.model.exec_tool import ARGUMENTS_TOO_DEEP, parse_wait_arguments
from codemode.model.registry import Deny, Tool
from codemode.model.toolfile import load_tool_file

pytestmark = pytest.mark.timeout(60)

DEEP = 100_000

#: A cell that calls `t` and shows what its `await` gave: the value or the rejection text.
CALL_T = (
    "try { text('ok ' + JSON.stringify(await tools.t({}))); }"
    " catch (e) { text('ERR ' + String(e)); }\ntext('after');"
)


def deep_list(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


def cyclic() -> dict[str, Any]:
    value: dict[str, Any] = {}
    value["self"] = value
    return value


class UnprintableError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ of a hostile exception")


def tool_of(kind: str, body: Callable[[], Any]) -> Tool[..., Any]:
    """The tool `t` running ``body`` as a worker-thread, inline, async or schema tool."""
    if kind == "async":

        async def run_async() -> Any:
            return body()

        return Tool(run_async, name="t")
    if kind == "schema":
        return Tool.from_schema("t", "", {"type": "object"}, lambda arguments: body())

    def run_sync() -> Any:
        return body()

    return Tool(run_sync, name="t", inline=kind == "inline")


async def cell_texts(registry: ToolRegistry, source: str) -> list[str]:
    async with CodeMode(registry) as code_mode, asyncio.timeout(30):
        rendered = await code_mode.handle_exec("call-1", source)
    return [item["text"] for item in rendered.to_json()[1:] if item["type"] == "input_text"]


@pytest.fixture
async def code_mode() -> AsyncIterator[CodeMode]:
    async with CodeMode() as opened:
        yield opened


def raise_(error: BaseException) -> Callable[[], Any]:
    def body() -> Any:
        raise error

    return body


# -- tools that raise what asyncio lets stop the process ---------------------------------------


@pytest.mark.parametrize("kind", ["sync", "inline", "async", "schema"])
async def test_a_tool_raising_system_exit_fails_its_call_and_the_host_runs_on(kind: str) -> None:
    # sys.exit() (or argparse given the arguments a cell chose) inside a tool used to end the
    # agent's process: asyncio re-raises SystemExit out of the event loop.
    registry = ToolRegistry([tool_of(kind, raise_(SystemExit(3)))])
    texts = await cell_texts(registry, CALL_T)
    assert texts == ["ERR tool `t` failed: SystemExit: 3", "after"]


@pytest.mark.parametrize("kind", ["sync", "schema"])
async def test_a_worker_thread_tool_raising_keyboard_interrupt_fails_its_call(kind: str) -> None:
    # Ctrl-C reaches only the main thread: from a worker it is the tool's own raise.
    registry = ToolRegistry([tool_of(kind, raise_(KeyboardInterrupt()))])
    texts = await cell_texts(registry, CALL_T)
    assert texts == ["ERR tool `t` failed: KeyboardInterrupt: ", "after"]


async def test_system_exit_through_a_timed_call_fails_its_call() -> None:
    registry = ToolRegistry()
    registry.add(tool_of("async", raise_(SystemExit("bye"))), timeout=5)
    assert await cell_texts(registry, CALL_T) == ["ERR tool `t` failed: SystemExit: bye", "after"]


@pytest.mark.parametrize("timed", [False, True])
@pytest.mark.parametrize("kind", ["sync", "inline", "async", "schema"])
async def test_a_tool_raising_cancelled_error_itself_fails_its_call(
    kind: str, timed: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # A CancelledError of the tool's own (nobody cancelled its call) reached the cell as
    # "code-mode delegate task was cancelled", naming no tool, and logged nothing.
    registry = ToolRegistry()
    registry.add(
        tool_of(kind, raise_(asyncio.CancelledError("gone"))), timeout=5 if timed else None
    )
    with caplog.at_level("ERROR", logger="codemode.tools"):
        texts = await cell_texts(registry, CALL_T)
    assert texts == ["ERR tool `t` failed: CancelledError: gone", "after"]
    assert [record.exc_info is not None for record in caplog.records] == [True]


async def test_a_tool_awaiting_a_cancelled_task_fails_its_call() -> None:
    # The usual way a tool meets a CancelledError of its own: it awaits another task (a shared
    # fetch, say) that someone cancelled.
    registry = ToolRegistry()

    @registry.tool(name="t")
    async def fetch() -> None:
        shared = asyncio.ensure_future(asyncio.sleep(10))
        asyncio.get_running_loop().call_soon(shared.cancel)
        await shared

    texts = await cell_texts(registry, CALL_T)
    assert texts == ["ERR tool `t` failed: CancelledError: ", "after"]


@pytest.mark.parametrize("kind", ["sync", "inline", "async"])
async def test_an_exception_whose_str_fails_is_still_the_tools_failure(kind: str) -> None:
    registry = ToolRegistry([tool_of(kind, raise_(UnprintableError()))])
    texts = await cell_texts(registry, CALL_T)
    assert texts == ["ERR tool `t` failed: UnprintableError: <exception str() failed>", "after"]


def undecodable_file() -> None:
    # A file name that is not UTF-8, as os.fsdecode gives it (a lone surrogate), in a message.
    raise ValueError("cannot parse report-\udcff.txt")


@pytest.mark.parametrize("kind", ["sync", "inline", "async", "schema"])
async def test_a_failure_text_with_lone_surrogates_reaches_the_cell(kind: str) -> None:
    # The text goes to the engine as UTF-8: the cell's call used to stay unsettled for ever.
    registry = ToolRegistry([tool_of(kind, undecodable_file)])
    texts = await cell_texts(registry, CALL_T)
    assert texts == [
        "ERR tool `t` failed: ValueError: cannot parse report-\ufffd.txt",
        "after",
    ]


async def test_an_own_error_text_with_lone_surrogates_reaches_the_cell() -> None:
    registry = ToolRegistry(before_call=lambda call: Deny("denied \ud800"))
    registry.add(tool_of("sync", raise_(CodeModeError("own \udc00 text"))))
    registry.add(
        Tool.from_schema("plain", "", {}, lambda _: raise_(CodeModeError("\ud83d\ude00 \ud800"))())
    )
    source = "for (const n of ['t', 'plain']) { try { await tools[n]({}); } catch (e) { text(String(e)); } }"
    assert await cell_texts(registry, source) == ["denied \ufffd", "denied \ufffd"]
    registry = ToolRegistry([tool_of("sync", raise_(CodeModeError("own \udc00 text")))])
    registry.add(
        Tool.from_schema("plain", "", {}, lambda _: raise_(CodeModeError("\ud83d\ude00 \ud800"))())
    )
    assert await cell_texts(registry, source) == ["own \ufffd text", "\U0001f600 \ufffd"]
    registry = ToolRegistry(timeout=5)
    registry.add(tool_of("async", raise_(CodeModeError("timed \udc00 text"))))
    assert await cell_texts(registry, CALL_T) == ["ERR timed \ufffd text", "after"]


def test_a_tool_name_with_a_lone_surrogate_is_refused() -> None:
    with pytest.raises(ValueError, match=r"has a lone surrogate: it is not text UTF-8 can carry$"):
        Tool.from_schema("read\udcff", "", {}, lambda arguments: None)
    with pytest.raises(ValueError, match=r"has a lone surrogate"):
        Tool(lambda: None, name="ok", namespace="ns\ud800")


def test_a_description_with_lone_surrogates_is_kept_as_replacement_characters() -> None:
    item = Tool.from_schema("t", "reads \udcff files", {}, lambda arguments: None)
    assert item.definition.description == "reads \ufffd files"

    def documented() -> None:
        """Reads \ud800 files."""

    assert Tool(documented).definition.description == "Reads \ufffd files."


# -- tool results that are not JSON ------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sync", "async", "schema"])
@pytest.mark.parametrize("result", [cyclic, lambda: deep_list(DEEP)], ids=["cyclic", "deep"])
async def test_a_cyclic_or_too_deep_result_is_a_clear_tool_error(
    kind: str, result: Callable[[], Any]
) -> None:
    registry = ToolRegistry([tool_of(kind, result)])
    texts = await cell_texts(registry, CALL_T)
    assert texts == [
        "ERR tool `t` returned a value that is not JSON: it is nested too deeply "
        "(or contains itself)",
        "after",
    ]


# -- hostile tool definitions ------------------------------------------------------------------


class Opaque:
    pass


@pytest.mark.parametrize(
    "schema",
    [
        {"const": Opaque()},
        {"enum": [1, Opaque()]},
        {"properties": {"a": {"default": {1, Opaque()}}}},
    ],
)
def test_a_schema_that_is_not_json_is_refused_when_the_tool_is_made(
    schema: dict[str, Any],
) -> None:
    # It used to be accepted, then made every exec description raise TypeError.
    with pytest.raises(TypeError, match=r"^tool `t`: input_schema is not JSON \(Encoding objects"):
        Tool.from_schema("t", "", schema, lambda arguments: None)
    with pytest.raises(TypeError, match=r"^tool `t`: output_schema is not JSON"):
        Tool.from_schema("t", "", {}, lambda arguments: None, output_schema=schema)

    def t() -> int:
        return 1

    with pytest.raises(TypeError, match=r"^tool `t`: output_schema is not JSON"):
        Tool(t, output_schema=schema)


def test_a_cyclic_or_too_deep_schema_is_refused_when_the_tool_is_made() -> None:
    deep: dict[str, Any] = {}
    for _ in range(DEEP):
        deep = {"items": deep}
    for schema in (cyclic(), deep):
        with pytest.raises(TypeError, match=r"input_schema is not JSON \(it is nested too deeply"):
            Tool.from_schema("t", "", schema, lambda arguments: None)


def test_a_schema_is_stored_as_the_json_it_means() -> None:
    # Integer keys, tuples and NaN have one JSON spelling: the renderer gets that, not Python.
    item = Tool.from_schema(
        "t",
        "",
        {"type": "object", "properties": {1: {"const": math.nan}}, "required": ("1",)},
        lambda arguments: None,
    )
    assert item.definition.input_schema == {
        "type": "object",
        "properties": {"1": {"const": None}},
        "required": ["1"],
    }
    assert 't(args: { "1": null; }): Promise<unknown>;' in CodeMode([item]).exec_description()


def test_a_description_must_be_text() -> None:
    with pytest.raises(TypeError, match=r"^tool `t`: description must be a string$"):
        Tool.from_schema("t", None, {}, lambda arguments: None)  # type: ignore[arg-type]


# -- what the model sends -----------------------------------------------------------------------


def test_wait_arguments_nested_past_the_decoder_are_a_parse_failure() -> None:
    nested = '{"cell_id": "1", "extra": ' + "[" * DEEP + "]" * DEEP + "}"
    with pytest.raises(CodeModeError) as raised:
        parse_wait_arguments(nested)
    assert raised.value.message == ARGUMENTS_TOO_DEEP
    assert ARGUMENTS_TOO_DEEP == "failed to parse function arguments: JSON nested too deeply"


async def test_a_too_deep_wait_call_is_answered_with_the_failure(code_mode: CodeMode) -> None:
    arguments = '{"cell_id": "1", "later": ' + "[" * DEEP + "]" * DEEP + "}"
    rendered = await code_mode.handle_wait(arguments)
    assert not rendered.success
    assert rendered.to_json() == [{"type": "input_text", "text": ARGUMENTS_TOO_DEEP}]


@pytest.mark.parametrize(
    "arguments", ['{"code": ' + "[" * DEEP + "]" * DEEP + "}", "[" * DEEP], ids=["value", "open"]
)
async def test_exec_function_arguments_nested_past_the_decoder_are_a_parse_failure(
    code_mode: CodeMode, arguments: str
) -> None:
    rendered = await code_mode.handle_exec_arguments("call-1", arguments)
    assert not rendered.success
    assert rendered.to_json() == [{"type": "input_text", "text": ARGUMENTS_TOO_DEEP}]


@pytest.mark.parametrize(
    ("tool", "arguments", "detail"),
    [
        ("wait", '{"cell_id": "\\ud800"}', "JSON is malformed: unpaired utf-16 surrogate escape"),
        ("wait", '{"cell_id": "1", "max_tokens": ' + "9" * 5000 + "}", "Integer value out of"),
        ("exec", '{"code": "text(1)", "n": ' + "9" * 5000 + "}", "integer of 5000 digits out"),
    ],
)
async def test_function_arguments_the_decoder_refuses_get_its_own_words(
    code_mode: CodeMode, tool: str, arguments: str, detail: str
) -> None:
    # Not msgspec's "Input data was truncated" for a whole text, nor Python's advice to raise
    # its digit limit: what the model can act on.
    if tool == "wait":
        rendered = await code_mode.handle_wait(arguments)
    else:
        rendered = await code_mode.handle_exec_arguments("call-1", arguments)
    assert not rendered.success
    (item,) = rendered.to_json()
    assert item["text"].startswith(f"failed to parse function arguments: {detail}")


async def test_anthropic_wait_input_nested_past_the_encoder_is_a_parse_failure(
    code_mode: CodeMode,
) -> None:
    block = {"type": "tool_use", "id": "u1", "name": "wait", "input": {"x": deep_list(DEEP)}}
    result = await code_mode.anthropic.handle(block)
    assert result["is_error"] is True
    assert result["content"] == [
        {
            "type": "text",
            "text": "failed to parse function arguments: Expected `object`, got `null`",
        }
    ]


async def test_a_pragma_nested_past_the_decoder_is_a_pragma_failure(code_mode: CodeMode) -> None:
    rendered = await code_mode.handle_exec("call-1", "// @exec: " + "[" * 5000 + "\ntext(1)")
    assert not rendered.success
    text = (
        "exec pragma must be valid JSON with supported fields `yield_time_ms` and "
        "`max_output_tokens`: recursion limit exceeded"
    )
    assert rendered.to_json() == [{"type": "input_text", "text": text}]


async def test_lone_surrogates_in_the_source_run_as_replacement_characters(
    code_mode: CodeMode,
) -> None:
    # JSON decoders pass "\ud800" escapes through into Python text, which UTF-8 cannot carry to
    # the engine: the cell used to wait for ever. A split pair is joined again.
    source = "text('a\ud800b'); text('\ud83d\ude00'); // \udfff"
    rendered = await asyncio.wait_for(code_mode.handle_exec("call-1", source), 30)
    assert [item["text"] for item in rendered.to_json()[1:]] == ["a\ufffdb", "\U0001f600"]
    arguments = json.dumps({"code": "text('\\ud800')"}).replace("\\\\", "\\")
    rendered = await asyncio.wait_for(code_mode.handle_exec_arguments("call-2", arguments), 30)
    assert [item["text"] for item in rendered.to_json()[1:]] == ["\ufffd"]


async def test_an_error_text_with_a_huge_line_number_is_rendered(code_mode: CodeMode) -> None:
    # With a pragma line removed, positions in error texts are moved; a cell-written "position"
    # of 5,000 digits used to make int() raise ValueError out of handle_exec.
    huge = "9" * 5000
    source = f'// @exec: {{}}\nthrow new Error("at exec_main.mjs:{huge}:1 and exec_main.mjs:1:2")'
    rendered = await code_mode.handle_exec("call-1", source)
    assert not rendered.success
    assert rendered.to_json()[-1]["text"].startswith(
        f"Script error:\nError: at exec_main.mjs:{huge}:1 and exec_main.mjs:2:2\n"
    )


def test_a_wav_clip_of_millions_of_chunks_is_not_walked_to_its_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An audio item's tokens come from its WAV clip's duration, found by walking its RIFF chunks
    # (render.py). A cell's 12 MB clip of 8-byte chunks took 1.5 million steps of Python, 0.9 s
    # of the event loop of the agent that rendered it, at every observation; now at most
    # MAX_WAV_CHUNKS are read, and such a clip counts as its URL, as any clip not measurable.
    steps = 0

    def unpack_from(layout: str, buffer: bytes, offset: int = 0) -> tuple[Any, ...]:
        nonlocal steps
        steps += 1
        return struct.unpack_from(layout, buffer, offset)

    monkeypatch.setattr(render, "struct", SimpleNamespace(unpack_from=unpack_from))
    fmt = b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, 8000, 8000, 1, 8)
    junk = b"junk\0\0\0\0" * (12 * 1024 * 1024 // 8)
    body = b"WAVE" + fmt + junk + b"data" + struct.pack("<I", 8000) + b"\0" * 8000
    url = "data:audio/wav;base64," + base64.b64encode(b"RIFF" + b"\0" * 4 + body).decode()
    assert render.audio_token_estimate(url) == render.estimate_tokens(url)
    assert steps <= 2 * render.MAX_WAV_CHUNKS + 2
    # A real clip (its chunks found first) is measured whatever comes after them.
    body = b"WAVE" + fmt + b"data" + struct.pack("<I", 8000) + b"\0" * 8000 + junk
    url = "data:audio/wav;base64," + base64.b64encode(b"RIFF" + b"\0" * 4 + body).decode()
    assert render.audio_token_estimate(url) == 10


# -- tool files -------------------------------------------------------------------------------


def test_a_tool_file_calling_sys_exit_at_import_fails_to_load(tmp_path: Path) -> None:
    # It used to end `codemode run` with the file's exit status and no word said.
    tools = tmp_path / "tools.py"
    tools.write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(CodeModeError, match=r"^failed to load tools from .*: SystemExit: 3$"):
        load_tool_file(tools)
