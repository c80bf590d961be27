"""``runtime.md`` §16.1: the JavaScript API, through the public session API of every carrier."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from codemode.protocol import CodeModeToolKind, InputText
from tests.contract.conftest import Harness
from tests.contract.delegate import ECHO, PATCH, RecordingDelegate, function_tool
from tests.contract.helpers import P, aud, img, items, run, start, wav, wav_url

IMAGE_ANY = (
    "image expects a non-empty image URL string, an object with image_url and optional detail, "
    "or a raw MCP image block"
)
REMOTE_IMAGE = (
    "Tool call failed: remote image URLs are not supported in tool outputs. "
    "Pass a base64 data URI instead"
)
INVALID_IMAGE = "Tool call failed: invalid image output. Pass a base64 data URI instead"
AUDIO_ANY = (
    "audio expects a non-empty audio URL string, an object with audio_url, or a raw MCP audio block"
)
OMITTED = "Audio output omitted because the clip is shorter than 25 ms; use a longer clip."
U599 = wav_url(599)

# (id, source, expected items, error): error None = ok, "^x" = starts with x, else exact.
CASES: list[tuple[str, str, list[Any], str | None]] = [
    ("R01", 'text("hi")', items("hi"), None),
    (
        "R02",
        'text(1); text(true); text(null); text(undefined); text(10n); text("s")',
        items("1", "true", "null", "undefined", "10", "s"),
        None,
    ),
    ("R03", 'text({b: [1, "x"], a: null})', items('{"b":[1,"x"],"a":null}'), None),
    ("R04", "text(() => 1)", items("undefined"), None),
    ("R05", "text()", items("undefined"), None),
    ("R06", "text(new Date(0))", items('"1970-01-01T00:00:00.000Z"'), None),
    (
        "R07",
        "const o = {}; o.o = o; text(o)",
        [],
        "^TypeError: Converting circular structure to JSON",
    ),
    ("R09", f'image("{P}")', [img(P)], None),
    ("R10", f'image("{P}", "LOW")', [img(P, "low")], None),
    ("R11", f'image({{image_url: "{P}", detail: "auto"}})', [img(P, "auto")], None),
    ("R12", f'image({{image_url: "{P}", detail: "high"}}, "original")', [img(P, "original")], None),
    (
        "R13",
        'image({type: "image", data: "iVBOR", mimeType: "image/png", '
        '_meta: {"codex/imageDetail": "original"}})',
        [img("data:image/png;base64,iVBOR", "original")],
        None,
    ),
    (
        "R14",
        'image({type: "image", data: "iVBOR", mimeType: "image/png", '
        '_meta: {"codex/imageDetail": "original"}}, "high")',
        [img("data:image/png;base64,iVBOR", "high")],
        None,
    ),
    (
        "R15",
        'image({type: "image", data: "AAA"})',
        [img("data:application/octet-stream;base64,AAA")],
        None,
    ),
    (
        "R16",
        'image({type: "image", data: "DATA:image/gif;base64,R0", mimeType: "image/png"})',
        [img("DATA:image/gif;base64,R0")],
        None,
    ),
    (
        "R17",
        'image({type: "image", data: "AAA", mimeType: "image/png", '
        '_meta: {"codex/imageDetail": "medium"}})',
        [img("data:image/png;base64,AAA")],
        None,
    ),
    ("R18", 'image("https://example.com/a.png")', [], REMOTE_IMAGE),
    ("R19a", 'image("ftp://x/a.png")', [], INVALID_IMAGE),
    ("R19b", 'image("not a url")', [], INVALID_IMAGE),
    (
        "R20",
        f'image("{P}", "medium")',
        [],
        "image detail must be one of: auto, low, high, original",
    ),
    ("R21a", f'image("{P}", 5)', [], "image detail must be a string when provided"),
    (
        "R21b",
        f'image({{image_url: "{P}", detail: 5}})',
        [],
        "image detail must be a string when provided",
    ),
    (
        "R22",
        'image({content: [{type: "image", data: "AAA", mimeType: "image/png"}], isError: false})',
        [],
        IMAGE_ANY,
    ),
    ("R23a", 'image("")', [], IMAGE_ANY),
    ("R23b", "image(42)", [], IMAGE_ANY),
    ("R23c", "image([])", [], IMAGE_ANY),
    (
        "R24",
        'image({type: "text", text: "x"})',
        [],
        'image only accepts MCP image blocks, got "text"',
    ),
    ("R25", 'image({type: "image", data: ""})', [], "image expected MCP image data"),
    (
        "R26",
        'text("before"); try { image("https://x/y.png") } catch (e) { text(typeof e) }',
        items("before", "string"),
        None,
    ),
    (
        "R27",
        f'generatedImage({{image_url: "{P}", output_hint: "saved"}})',
        [img(P), InputText("saved")],
        None,
    ),
    ("R28", 'generatedImage({image_url: "https://x/y.png"})', [], REMOTE_IMAGE),
    (
        "R29",
        f'generatedImage("{P}")',
        [],
        "generatedImage expects an image generation result object",
    ),
    (
        "R30",
        f'generatedImage({{image_url: "{P}", output_hint: 3}})',
        [],
        "generatedImage output_hint must be a string when provided",
    ),
    ("R31", f'audio("{wav_url(600)}")', [aud(wav_url(600))], None),
    ("R32a", f'audio("{U599}")', items(OMITTED), None),
    ("R32b", f'audio("{wav_url(0)}")', items(OMITTED), None),
    ("R32c", f'audio("{wav_url(1)}")', items(OMITTED), None),
    (
        "R33",
        f'audio("{U599}"); audio({{audio_url: "{U599}"}}); '
        f'audio({{type: "audio", data: "{wav(599)}", mimeType: "audio/wav"}})',
        items(OMITTED, OMITTED, OMITTED),
        None,
    ),
    ("R34a", f'audio("{wav_url(1102, 44_100)}")', items(OMITTED), None),
    ("R34b", f'audio("{wav_url(1103, 44_100)}")', [aud(wav_url(1103, 44_100))], None),
    ("R35", f'audio("{wav_url(600, declared_data=2)}")', items(OMITTED), None),
    ("R36", 'audio("data:audio/mpeg;base64,AAAA")', [aud("data:audio/mpeg;base64,AAAA")], None),
    (
        "R37",
        'audio("https://x/a.wav")',
        [],
        "Tool call failed: invalid audio output. Pass a base64 data URI instead",
    ),
    (
        "R38",
        'audio({type: "image", data: "AAA"})',
        [],
        'audio only accepts MCP audio blocks, got "image"',
    ),
    ("R39", 'audio({type: "audio", data: ""})', [], "audio expected MCP audio data"),
    ("R40a", "audio(42)", [], AUDIO_ANY),
    ("R40b", 'audio("")', [], AUDIO_ANY),
    ("R42", 'text(String(load("missing")))', items("undefined"), None),
    (
        "R43",
        'store("f", () => 1)',
        [],
        "failed to serialize JavaScript value: expected value at line 1 column 1",
    ),
    (
        "R44",
        'store("u")',
        [],
        'Unable to store "u". Only plain serializable objects can be stored.',
    ),
    (
        "R45",
        "store('a\"b', undefined)",
        [],
        'Unable to store "a\\"b". Only plain serializable objects can be stored.',
    ),
    ("R46", 'store("n", 10n)', [], "^TypeError: Do not know how to serialize a BigInt"),
    ("R47", 'store(7, "x"); text(load("7"))', items("x"), None),
    (
        "R48",
        'store("k", {a: 1}); const v = load("k"); v.a = 2; text(String(load("k").a))',
        items("1"),
        None,
    ),
    (
        "R49",
        'store("k", {d: new Date(0), u: undefined}); text(JSON.stringify(load("k")))',
        items('{"d":"1970-01-01T00:00:00.000Z"}'),
        None,
    ),
    ("R52", 'notify("  \\n ")', [], "notify expects non-empty text"),
    ("R56", 'text("before"); exit(); text("after")', items("before"), None),
    (
        "R57",
        'try { exit(); } catch (e) { text("caught"); } finally { text("finally"); } text("after")',
        [],
        None,
    ),
    ("R58", 'await Promise.resolve(); text("a"); exit(); text("b")', items("a"), None),
    ("R60", 'setTimeout(() => text("late"), 0); text("a"); exit()', items("a"), None),
    ("R61", 'setTimeout(() => text("late"), 10); text("now")', items("now"), None),
    ("R62", 'await new Promise(r => setTimeout(r, 20)); text("after")', items("after"), None),
    (
        "R63",
        'const id = setTimeout(() => text("x"), 10); clearTimeout(id); '
        'await new Promise(r => setTimeout(r, 50)); text("y")',
        items("y"),
        None,
    ),
    ("R64", 'setTimeout(() => { throw "boom"; }, 0); await new Promise(() => {})', [], "boom"),
    ("R65", 'setTimeout("text(1)", 0)', [], "setTimeout expects a function callback"),
    ("R66", 'clearTimeout("abc")', [], None),
    ("R66b", "clearTimeout(Symbol())", [], "clearTimeout expects a numeric timeout id"),
    (
        "R67",
        'clearTimeout(); clearTimeout(null); clearTimeout(999); clearTimeout(-1); text("ok")',
        items("ok"),
        None,
    ),
    (
        "R68",
        "text(String([setTimeout(() => {}, 1e6), setTimeout(() => {}, 1e6)]))",
        items("1,2"),
        None,
    ),
    (
        "R69",
        'setTimeout(function (...a) { text(String(this) + ":" + a.length) }, 0, "x"); '
        "await new Promise(r => setTimeout(r, 20))",
        items("undefined:0"),
        None,
    ),
    (
        "R72",
        'try { await tools.fail({}) } catch (e) { text(typeof e + ":" + e) }',
        items("string:boom"),
        None,
    ),
    ("R73", "await tools.fail({})", [], "boom"),
    ("R74", "text(JSON.stringify(await tools.echo()))", items("{}"), None),
    ("R75", 'await tools.echo("x")', [], "tool `echo` expects a JSON object for arguments"),
    ("R76", 'text(await tools.patch("*** Begin"))', items("patched:*** Begin"), None),
    ("R77", "await tools.patch({a: 1})", [], "tool `patch` expects a string input"),
    (
        "R78",
        "text(JSON.stringify(await tools.echo({d: new Date(0), u: undefined, f() {}})))",
        items('{"d":"1970-01-01T00:00:00.000Z"}'),
        None,
    ),
    ("R82", "text(typeof tools.hidden_dynamic_tool)", items("function"), None),
    ("R83", "await tools.nope({})", [], "^TypeError"),
    (
        "R84",
        "text([typeof console, typeof Atomics, typeof SharedArrayBuffer, typeof WebAssembly].join())",
        items("undefined,undefined,undefined,undefined"),
        None,
    ),
    ("R85", 'text(String(Object.hasOwn(globalThis, "console")))', items("false"), None),
    (
        "R86",
        "text([typeof fetch, typeof require, typeof process, typeof XMLHttpRequest, "
        "typeof WebSocket, typeof forward_output].join())",
        items(",".join(["undefined"] * 6)),
        None,
    ),
    ("R89", 'import fs from "fs"; text("x")', [], "Unsupported import in exec: fs"),
    ("R90", 'await import("fs")', [], "unsupported import in exec"),
    ("R91", 'throw "plain"', [], "plain"),
    ("R92", 'throw new Error("boom")', [], "^Error: boom"),
    # A cell that names itself with `//# sourceURL` (V8 reports its positions untranslated): the
    # error text has the columns of its first line as the model wrote them (upstream 0.171.0).
    (
        "R92b",
        'text(1); throw new Error("x")\n//# sourceURL=cell.js',
        items("1"),
        "Error: x\n    at cell.js:1:16",
    ),
    (
        "R92c",
        'async function f() { await null; throw new Error("a") } await f() '
        "//# sourceURL=http://h/a.js",
        [],
        "Error: a\n    at f (http://h/a.js:1:40)\n    at async http://h/a.js:1:57",
    ),
    ("R93", "throw {a: 1}", [], "[object Object]"),
    ("R94", 'throw {stack: "custom stack"}', [], "custom stack"),
    ("R95", "const = 1", [], "^SyntaxError"),
    ("R96", 'await Promise.reject("nope")', [], "nope"),
    (
        "R97",
        'Promise.reject(new Error("x")); (async () => { throw "y" })(); text("ok")',
        items("ok"),
        None,
    ),
    ("R98", 'text("partial"); throw "x"', items("partial"), "x"),
]


@pytest.mark.parametrize(
    ("source", "expected", "error"),
    [pytest.param(source, expected, error, id=case) for case, source, expected, error in CASES],
)
async def test_case(harness: Harness, source: str, expected: list[Any], error: str | None) -> None:
    session = await harness.session()
    result = await run(session, source)
    assert result.content_items == expected
    if error is None:
        assert result.error_text is None
    elif error.startswith("^"):
        assert result.error_text is not None and result.error_text.startswith(error[1:]), (
            result.error_text
        )
    else:
        assert result.error_text == error


async def test_r08_helpers_return_undefined_and_notify(harness: Harness) -> None:
    delegate = RecordingDelegate()
    session = await harness.session(delegate)
    result = await run(
        session,
        f'text(JSON.stringify([text("a"), image("{P}"), notify("n")].map(v => v === undefined)))',
    )
    assert result.content_items == [InputText("a"), img(P), InputText("[true,true,true]")]
    assert result.error_text is None
    assert delegate.notifications == [("call-1", "1", "n")]


async def test_r41_store_then_load_in_another_cell(harness: Harness) -> None:
    session = await harness.session()
    first = await run(session, 'store("k", {a: [1, "x"]})')
    assert (first.content_items, first.error_text) == ([], None)
    second = await run(session, 'text(JSON.stringify(load("k")))')
    assert second.content_items == items('{"a":[1,"x"]}')


async def test_r50_error_completion_commits(harness: Harness) -> None:
    session = await harness.session()
    assert (await run(session, 'store("e", 1); throw "x"')).error_text == "x"
    assert (await run(session, 'text(String(load("e")))')).content_items == items("1")


async def test_r51_notification_delivered_before_the_result(harness: Harness) -> None:
    delegate = RecordingDelegate()
    session = await harness.session(delegate)
    result = await run(session, 'notify("hello"); text("done")')
    assert result.content_items == items("done")
    assert delegate.notifications == [("call-1", "1", "hello")]


async def test_r53_notify_object(harness: Harness) -> None:
    delegate = RecordingDelegate()
    session = await harness.session(delegate)
    result = await run(session, "notify({a: 1})")
    assert (result.content_items, result.error_text) == ([], None)
    assert delegate.notifications == [("call-1", "1", '{"a":1}')]


@pytest.mark.parametrize(
    ("source", "first", "second"),
    [
        ('text("before"); yield_control(); text("after")', "before", "after"),
        ('text("a"); await yield_control(); text("b")', "a", "b"),
    ],
    ids=["R54", "R55"],
)
async def test_yield_control_then_wait(
    harness: Harness, source: str, first: str, second: str
) -> None:
    from codemode.protocol import CellId, LiveCell, Result, WaitRequest, Yielded

    session = await harness.session()
    cell, response = await start(session, source, yield_ms=60_000)
    assert response == Yielded(CellId(cell), items(first))
    outcome = await session.wait(WaitRequest(CellId(cell), 60_000))
    assert outcome == LiveCell(Result(CellId(cell), items(second), None))


async def test_r59_exit_commits_stores(harness: Harness) -> None:
    session = await harness.session()
    assert (await run(session, 'store("x", 1); exit()')).error_text is None
    assert (await run(session, 'text(String(load("x")))')).content_items == items("1")


async def test_r70_r71_nested_calls(harness: Harness) -> None:
    delegate = RecordingDelegate()
    session = await harness.session(delegate)
    result = await run(session, "const r = await tools.echo({value: 1}); text(JSON.stringify(r))")
    assert result.content_items == items('{"value":1}')
    call = delegate.calls[0]
    assert (call.tool_name.name, call.tool_kind, call.runtime_tool_call_id, call.input) == (
        "echo",
        CodeModeToolKind.FUNCTION,
        "tool-1",
        {"value": 1},
    )
    assert str(call.cell_id) == "1"
    result = await run(session, "await Promise.all([tools.echo({a: 1}), tools.echo({a: 2})])")
    assert result.error_text is None
    assert [c.runtime_tool_call_id for c in delegate.calls[1:]] == ["tool-1", "tool-2"]
    assert sorted(c.input["a"] for c in delegate.calls[1:]) == [1, 2]


async def test_r74_no_input_reaches_the_delegate_as_none(harness: Harness) -> None:
    delegate = RecordingDelegate()
    session = await harness.session(delegate)
    await run(session, "await tools.echo()")
    assert delegate.calls[0].input is None
    assert delegate.dispatched == [("echo", {})]


async def test_r79_unserializable_argument_throws_synchronously(harness: Harness) -> None:
    delegate = RecordingDelegate()
    session = await harness.session(delegate)
    result = await run(
        session, 'const o = {}; o.o = o; try { tools.echo(o); } catch (e) { text("sync") }'
    )
    assert result.content_items == items("sync")
    assert delegate.calls == []


async def test_r80_unawaited_call_is_cancelled(harness: Harness) -> None:
    delegate = RecordingDelegate()
    session = await harness.session(delegate)
    result = await asyncio.wait_for(run(session, 'tools.block({}); text("done")'), 5)
    assert result.content_items == items("done")
    assert delegate.cancelled == ["tool-1"]


async def test_r81_all_tools(harness: Harness) -> None:
    session = await harness.session()
    result = await run(session, "text(JSON.stringify(ALL_TOOLS))", tools=[ECHO, PATCH])
    assert result.content_items == items(
        '[{"name":"echo","description":"Echo tool"},{"name":"patch","description":"Patch tool"}]'
    )


async def test_r87_store_load_disabled(harness: Harness) -> None:
    session = await harness.session(store_load=False)
    result = await run(session, 'text(typeof store + "," + typeof load)')
    assert result.content_items == items("undefined,undefined")


async def test_r88_intl(harness: Harness) -> None:
    session = await harness.session()
    result = await run(
        session,
        'text(new Date("2025-01-02T03:04:05Z").toLocaleString("fr-FR", {weekday: "long", '
        'month: "long", day: "numeric", hour: "2-digit", minute: "2-digit", second: "2-digit", '
        'hour12: false, timeZone: "UTC"}))',
    )
    assert result.content_items == items("jeudi 2 janvier à 03:04:05")


async def test_r92_stack_names_the_module(harness: Harness) -> None:
    session = await harness.session()
    result = await run(session, 'throw new Error("boom")')
    assert result.error_text is not None and "exec_main.mjs" in result.error_text


class _NonFiniteDelegate(RecordingDelegate):
    async def invoke_tool(self, invocation: Any, cancellation: Any) -> Any:
        return {"value": float("nan")}


async def test_non_finite_tool_result_is_not_json(harness: Harness) -> None:
    session = await harness.session(_NonFiniteDelegate())
    result = await run(session, "try { await tools.echo({}) } catch (e) { text(e) }")
    assert result.content_items == items(
        "code-mode delegate returned a value that is not JSON: nan is not a JSON number"
    )


async def test_tools_with_one_identifier_are_all_listed_and_the_last_is_called(
    harness: Harness,
) -> None:
    first, last = function_tool("echo-x", "first"), function_tool("echo_x", "second")
    delegate = RecordingDelegate(enabled=[first, last])
    session = await harness.session(delegate)
    source = "text(JSON.stringify(ALL_TOOLS)); await tools.echo_x({v: 1});"
    result = await run(session, source, tools=[first, last])
    listed = '[{"name":"echo_x","description":"first"},{"name":"echo_x","description":"second"}]'
    assert result.content_items == items(listed)
    assert [call.tool_name.name for call in delegate.calls] == ["echo_x"]
