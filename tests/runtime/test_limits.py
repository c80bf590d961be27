"""What one cell may take: output, tool calls, store; each limit ends in a clear error."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator

import pytest

from codemode.protocol import ExecuteRequest, ImageDetail, InputImage, InputText, Result
from codemode.runtime import LocalSession, LocalSessionProvider
from codemode.runtime import session as session_module
from codemode.runtime.cell import PENDING_CONTAINERS_TOO_MANY, PENDING_VALUES_TOO_MANY
from tests.contract.delegate import FIXTURE_TOOLS, RecordingDelegate


@pytest.fixture
async def session() -> AsyncIterator[LocalSession]:
    async with LocalSessionProvider() as provider:
        yield await provider.create_session(RecordingDelegate())


async def run(session: LocalSession, source: str) -> Result:
    started = await session.execute(
        ExecuteRequest(
            tool_call_id="c", source=source, enabled_tools=list(FIXTURE_TOOLS), yield_time_ms=60_000
        )
    )
    result = await started.initial_response()
    assert isinstance(result, Result)
    return result


async def test_a_flood_of_empty_items_is_bounded(session: LocalSession) -> None:
    result = await run(session, 'for (;;) text("")')
    # Python's bound on output waiting for an observer comes first (64 characters an item).
    assert result.error_text == "exec cell output exceeds the limit of 16777216 characters"
    assert len(result.content_items) == (16 << 20) // 64 + 1


async def test_buffered_items_cost_the_cyclic_collector_nothing(session: LocalSession) -> None:
    # A session may buffer about a million items (64 characters each against its bounds): held
    # as objects the collector tracks, every full collection walked them all (about 70 ms each).
    await run(session, "text('warm')")
    gc.collect()
    tracked_before = len(gc.get_objects())
    started = await session.execute(
        ExecuteRequest(
            tool_call_id="c",
            source="for (let i = 0; i < 20000; i++) text('x' + i); image('data:image/png;base64,"
            "AAAA'); await new Promise(() => {})",
            enabled_tools=[],
            yield_time_ms=60_000,
        )
    )
    try:
        async with asyncio.timeout(30):
            while session.buffered_output < 20_001 * 64:
                await asyncio.sleep(0.01)
        gc.collect()
        assert len(gc.get_objects()) - tracked_before < 2_000
    finally:
        outcome = await session.terminate(started.cell_id)
    items = outcome.response.content_items
    assert items[:2] == [InputText("x0"), InputText("x1")] and len(items) == 20_001
    assert items[-1] == InputImage("data:image/png;base64,AAAA", ImageDetail.HIGH)


async def test_output_buffered_for_one_observation_is_bounded(session: LocalSession) -> None:
    result = await run(session, 'for (let i = 0; i < 40; i++) text("x".repeat(1 << 20))')
    assert result.error_text == "exec cell output exceeds the limit of 16777216 characters"
    assert 0 < len(result.content_items) <= 16


async def test_unsettled_tool_calls_of_one_cell_are_bounded(session: LocalSession) -> None:
    result = await run(
        session,
        "const calls = Array.from({length: 4100}, () => tools.block({}));"
        "try { await Promise.race(calls.slice(4096)); } catch (e) { text(e); }",
    )
    assert result.error_text is None
    assert result.content_items == [
        InputText("too many pending tool calls in this cell (limit 4096)")
    ]


async def test_what_one_cell_stores_is_bounded(session: LocalSession) -> None:
    result = await run(
        session,
        'store("a", "x".repeat(40 << 20)); store("a", "y".repeat(40 << 20)); text("ok");'
        'store("b", "z".repeat(30 << 20))',
    )
    assert result.error_text == "store exceeds the limit of 67108864 characters written per cell"


async def test_tiny_store_entries_count_for_their_key_too(session: LocalSession) -> None:
    # Each key counts 256 characters beyond its own: 64 Mi characters of one-character values
    # under short keys were 16 million entries, which the host paid for per entry (decoding them
    # held its event loop for seconds and took gigabytes).
    result = await run(
        session, "let i = 0; try { for (;; i++) store(i, 0) } catch (e) { text(String(e)) } text(i)"
    )
    assert result.error_text is None
    texts = [item.text for item in result.content_items]  # type: ignore[union-attr]
    assert texts[0] == "store exceeds the limit of 67108864 characters written per cell"
    assert 64 * 2**20 // (256 + 8) <= int(texts[1]) <= 64 * 2**20 // (256 + 2)


async def test_the_session_store_is_bounded(
    session: LocalSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(session_module, "MAX_STORE_CHARS", 1000)
    assert (await run(session, 'store("a", "x".repeat(600))')).error_text is None
    refused = await run(session, 'store("b", "x".repeat(600)); text("done")')
    assert refused.error_text == (
        "exec cell store writes were discarded: the session store would exceed 1000 characters"
    )
    kept = await run(session, 'text(String(load("a").length)); text(String(load("b")))')
    assert [item.text for item in kept.content_items] == ["600", "undefined"]  # type: ignore[union-attr]


@pytest.mark.timeout(60)
async def test_the_error_text_of_a_huge_message_is_made_in_linear_time(
    session: LocalSession,
) -> None:
    # The eval origins of the stack's lines were found by a regular expression that scanned from
    # every `eval at ` to the next parenthesis: this message kept the engine busy for 4 minutes.
    result = await run(session, 'throw new Error("eval at ".repeat(200000))')
    assert result.error_text is not None
    assert result.error_text.startswith("Error: " + "eval at " * 1000)


async def test_the_json_values_of_unsettled_tool_inputs_are_bounded(session: LocalSession) -> None:
    # Three characters of `{}` decode to ≈90 bytes of Python: a call of 44 million of them,
    # within the bound on characters, took 3 GB and stalled the event loop for seconds.
    result = await run(
        session,
        "try { await tools.echo({a: new Array(5_000_000).fill({})}) } catch (e) { text(e) }\n"
        'const csv = "a,b:c\\n".repeat(2_000_000);\n'  # separators inside a string do not count
        "text(String((await tools.echo({csv})).csv === csv))",
    )
    assert result.error_text is None
    assert result.content_items == [InputText(PENDING_VALUES_TOO_MANY), InputText("true")]


async def test_the_arrays_and_objects_of_unsettled_tool_inputs_are_bounded(
    session: LocalSession,
) -> None:
    # Guards the bound on arrays and objects (cell.py): two million empty arrays are within the
    # bound on values, and decoding them (each a Python object the cyclic collector walks again
    # and again) held the event loop of every session for 0.5 to 2.5 s per call. Brackets inside a
    # string do not count.
    result = await run(
        session,
        "const many = Array.from({length: 600_000}, () => []);\n"
        "try { await tools.echo({many}) } catch (e) { text(e) }\n"
        "const nested = Array.from({length: 5_000}, () => JSON.parse('['.repeat(120) + ']'.repeat(120)));\n"
        "try { await tools.echo({nested}) } catch (e) { text(e) }\n"
        "const fewer = Array.from({length: 500_000}, () => []);\n"
        "const brackets = '[{'.repeat(1_000_000);\n"
        "const back = await tools.echo({fewer, brackets});\n"
        "text(String(back.fewer.length === 500_000 && back.brackets === brackets))",
    )
    assert result.error_text is None
    assert result.content_items == [
        InputText(PENDING_CONTAINERS_TOO_MANY),
        InputText(PENDING_CONTAINERS_TOO_MANY),
        InputText("true"),
    ]


async def test_notifications_do_not_count_against_the_output_limit(session: LocalSession) -> None:
    # runtime.md §7: a notification's delivery never affects the cell. The second of these used
    # to throw `exec cell output exceeds the limit of 67108864 characters`; upstream sends both.
    result = await run(
        session, 'notify("x".repeat(40_000_000)); notify("y".repeat(40_000_000)); text("ok")'
    )
    assert (result.content_items, result.error_text) == ([InputText("ok")], None)
