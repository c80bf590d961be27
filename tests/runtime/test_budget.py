"""The characters all sessions of a provider hold for their cells, bounded together."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator

import pytest

from codemode.client import ProcessOwnedCodeModeSessionProvider
from codemode.protocol import ExecuteRequest, InputText, Result, Yielded
from codemode.protocol.types import LiveCell, WaitRequest
from codemode.runtime import LocalSession, LocalSessionProvider, budget
from codemode.runtime.budget import HeldCharacters, ResidentMemory, default_held_chars
from codemode.runtime.session import (
    DEFAULT_MAX_HELD_CHARS,
    DEFAULT_TOTAL_MEMORY_CAP_BYTES,
    MIN_HELD_CHARS,
)
from tests.contract import helpers
from tests.contract.delegate import RecordingDelegate

pytestmark = pytest.mark.timeout(60)

LIMIT = 1_000_000
HOST_LIMIT = f"the host's limit of {LIMIT} characters held for the cells of all its sessions"
#: Over half the limit: two of them do not fit together, one does.
BIG = 600_000


@pytest.fixture
async def provider() -> AsyncIterator[LocalSessionProvider]:
    async with LocalSessionProvider(max_held_chars=LIMIT) as provider:
        yield provider


async def start(session: LocalSession, source: str, yield_ms: int = 60_000) -> Result | Yielded:
    _, response = await helpers.start(session, source, yield_ms=yield_ms)
    assert isinstance(response, Result | Yielded)
    return response


async def completed(session: LocalSession, source: str) -> Result:
    return await helpers.run(session, source, yield_ms=60_000)


def texts(result: Result | Yielded) -> list[str]:
    return [item.text for item in result.content_items if isinstance(item, InputText)]


def test_the_default_is_a_quarter_of_the_memory_and_never_below_one_session() -> None:
    assert DEFAULT_MAX_HELD_CHARS == default_held_chars(MIN_HELD_CHARS) >= MIN_HELD_CHARS
    assert default_held_chars(1 << 60) == 1 << 60
    assert MIN_HELD_CHARS == (256 + 64 + 128) << 20


@pytest.mark.parametrize(
    ("memory", "engines"),
    [(24 << 30, 256), (4 << 30, 64), (1 << 30, 16), (512 << 20, 16), (None, 256)],
)
def test_the_default_engine_bound_fits_idle_engines_in_a_quarter_of_the_memory(
    monkeypatch: pytest.MonkeyPatch, memory: int | None, engines: int
) -> None:
    monkeypatch.setattr(budget, "physical_memory", lambda: memory)
    assert budget.default_max_engines(256, 16) == engines


def test_the_limit_is_checked() -> None:
    with pytest.raises(ValueError, match="max_held_chars"):
        HeldCharacters(0)
    assert HeldCharacters(None).room() > 1 << 60
    assert HeldCharacters(10).room() == 10


def test_past_half_the_limit_a_session_grows_only_to_an_equal_share() -> None:
    held = HeldCharacters(100)
    assert held.room(0) == 100  # nobody holds anything: all of it
    held.chars, held.holders = 90, 1
    assert held.room(90) == 10  # alone, it may take the rest
    assert held.room(0) == 10  # a newcomer gets what is left
    held.chars, held.holders = 60, 2  # 55 and 5
    assert held.room(55) == -5  # past its share of 50: no more
    assert held.room(5) == 40  # up to its share, within what is left
    assert held.refusal(55, 1) == (
        "its session's share (50 characters, 2 sessions) of the host's limit of 100 characters "
        "held for the cells of all its sessions"
    )
    assert held.refusal(5, 41) == (
        "the host's limit of 100 characters held for the cells of all its sessions"
    )
    held.chars, held.holders = 40, 3  # below half the limit, anyone may grow up to it
    assert held.room(35) == 10


async def test_a_session_past_its_share_cannot_take_the_rest_from_the_others(
    provider: LocalSessionProvider,
) -> None:
    hog = await provider.create_session(RecordingDelegate())
    other = await provider.create_session(RecordingDelegate())
    # Alone it may grow (up to half the limit, and past it to all of it while alone).
    assert (await completed(hog, 'store("a", "x".repeat(450000))')).error_text is None
    assert (await completed(other, 'store("b", "y".repeat(100000))')).error_text is None
    assert provider.held.holders == 2
    refused = await completed(hog, 'store("c", "x".repeat(200000))')
    assert refused.error_text == (
        "exec cell store writes were discarded: they would pass its session's share "
        f"({LIMIT // 2} characters, 2 sessions) of {HOST_LIMIT}"
    )
    # The other session still grows to its share.
    assert (await completed(other, 'store("d", "y".repeat(350000))')).error_text is None
    await hog.shutdown()
    assert provider.held.holders == 1


async def test_a_store_write_that_would_pass_the_host_limit_is_discarded(
    provider: LocalSessionProvider,
) -> None:
    first = await provider.create_session(RecordingDelegate())
    second = await provider.create_session(RecordingDelegate())
    assert (await completed(first, f'store("a", "x".repeat({BIG}))')).error_text is None
    refused = await completed(second, f'store("b", "y".repeat({BIG})); text("ran")')
    assert (
        refused.error_text == f"exec cell store writes were discarded: they would pass {HOST_LIMIT}"
    )
    assert texts(refused) == ["ran"]
    again = await completed(second, 'text(String(load("b")))')
    assert texts(again) == ["undefined"]  # discarded, not kept in part
    # A session's own writes that replace its values count only what they add.
    assert (await completed(first, f'store("a", "z".repeat({BIG}))')).error_text is None
    # A shut down session's store gives its room back.
    await first.shutdown()
    assert provider.held.chars == 0
    assert (await completed(second, f'store("b", "y".repeat({BIG}))')).error_text is None
    assert provider.held.chars > BIG


async def test_output_that_would_pass_the_host_limit_ends_its_cell(
    provider: LocalSessionProvider,
) -> None:
    holder = await provider.create_session(RecordingDelegate())
    other = await provider.create_session(RecordingDelegate())
    # Output written after the first observation waits for the next one.
    first = await start(
        holder,
        f'await new Promise(r => setTimeout(r, 100)); text("x".repeat({BIG})); '
        "await new Promise(() => {})",
        yield_ms=10,
    )
    assert isinstance(first, Yielded)
    while provider.held.chars < BIG:
        await asyncio.sleep(0.01)
    ended = await completed(other, f'text("a"); text("y".repeat({BIG})); text("b")')
    assert ended.error_text == f"exec cell output exceeds {HOST_LIMIT}"
    assert texts(ended) == ["a"]
    # The holder's cell kept its output, and handing it out gives the room back.
    outcome = await holder.terminate(first.cell_id)
    assert isinstance(outcome, LiveCell)
    assert [len(t) for t in texts(outcome.response)] == [BIG]  # type: ignore[arg-type]
    assert (await completed(other, f'text("y".repeat({BIG}))')).error_text is None
    await holder.shutdown()
    await other.shutdown()
    assert provider.held.chars == 0


async def test_a_tool_input_that_would_pass_the_host_limit_is_refused(
    provider: LocalSessionProvider,
) -> None:
    holder = await provider.create_session(RecordingDelegate())
    other = await provider.create_session(RecordingDelegate())
    blocked = await start(holder, f'await tools.block({{s: "x".repeat({BIG})}})', yield_ms=10)
    assert isinstance(blocked, Yielded)
    while provider.held.chars < BIG:
        await asyncio.sleep(0.01)
    refused = await completed(
        other,
        f'try {{ await tools.echo({{s: "y".repeat({BIG})}}) }} catch (e) {{ text(String(e)) }}',
    )
    assert texts(refused) == [f"tool call refused: its input would pass {HOST_LIMIT}"]
    # Ending the holder's call gives its room back.
    await holder.terminate(blocked.cell_id)
    assert provider.held.chars == 0
    echoed = await completed(
        other, f'text(String((await tools.echo({{s: "y".repeat({BIG})}})).s.length))'
    )
    assert texts(echoed) == [str(BIG)]
    await holder.shutdown()
    await other.shutdown()
    assert provider.held.chars == 0


async def test_without_a_limit_nothing_is_refused() -> None:
    async with LocalSessionProvider(max_held_chars=None) as provider:
        sessions = [await provider.create_session(RecordingDelegate()) for _ in range(2)]
        for session in sessions:
            result = await completed(session, f'store("a", "x".repeat({BIG})); text("ok")')
            assert result.error_text is None
        assert provider.held.chars > 2 * BIG


async def test_the_host_command_applies_its_limit_over_stdio() -> None:
    command = [sys.executable, "-m", "codemode", "host", "--stdio", "--max-held-chars", str(LIMIT)]
    async with ProcessOwnedCodeModeSessionProvider(command) as provider:
        first = await provider.create_session(RecordingDelegate())
        second = await provider.create_session(RecordingDelegate())
        outcomes = []
        for session, key in ((first, "a"), (second, "b")):
            started = await session.execute(
                ExecuteRequest(
                    tool_call_id="c",
                    source=f'store("{key}", "x".repeat({BIG})); text("ran")',
                    yield_time_ms=60_000,
                )
            )
            response = await started.initial_response()
            assert isinstance(response, Result)
            outcomes.append(response.error_text)
        assert outcomes == [
            None,
            f"exec cell store writes were discarded: they would pass {HOST_LIMIT}",
        ]


def test_resident_memory_names_the_engine_that_grew_the_most_since_it_was_within() -> None:
    resident = ResidentMemory(100)
    steady, grower, late = object(), object(), object()
    assert resident.report(steady, 60) is None
    assert resident.report(grower, 10) is None
    assert resident.report(steady, 62) is None and resident.total == 72
    # The grower takes the total past the limit: it is named, not the larger, steady engine.
    assert resident.report(grower, 45) is grower
    assert resident.report(steady, 62) is grower  # whoever reports next
    resident.forget(grower)
    assert resident.total == 62
    # An engine first seen past the limit counts all it holds.
    assert resident.report(late, 50) is late
    resident.forget(late)
    assert resident.report(steady, 63) is None
    assert ResidentMemory(None).report(steady, 1 << 50) is None
    with pytest.raises(ValueError, match="total_memory_cap_bytes"):
        ResidentMemory(0)


async def test_the_default_total_memory_cap_is_never_below_one_engines_cap() -> None:
    big = DEFAULT_TOTAL_MEMORY_CAP_BYTES + (1 << 30)
    async with LocalSessionProvider(memory_cap_bytes=big, warm_engines=0) as provider:
        assert provider.pool.resident.limit == big
    async with LocalSessionProvider(warm_engines=0) as provider:
        assert provider.pool.resident.limit == DEFAULT_TOTAL_MEMORY_CAP_BYTES
    # One given is the user's: it stays, even below an engine's cap.
    async with LocalSessionProvider(
        memory_cap_bytes=big, total_memory_cap_bytes=1 << 30, warm_engines=0
    ) as provider:
        assert provider.pool.resident.limit == 1 << 30


#: A cell that makes ``MB`` megabytes resident (typed arrays, filled), then waits for ever.
def _resident_cell(megabytes: int) -> str:
    return (
        f"const kept = []; for (let i = 0; i < {megabytes}; i++) kept.push(new Uint8Array(1 << 20)"
        ".fill(i & 255)); text('held'); await new Promise(() => {})"
    )


async def test_engines_past_the_total_cap_lose_the_one_that_grew_and_the_others_go_on() -> None:
    cap = 450 << 20
    async with LocalSessionProvider(total_memory_cap_bytes=cap, warm_engines=0) as provider:
        large = await provider.create_session(RecordingDelegate())
        grower = await provider.create_session(RecordingDelegate())
        first = await start(large, _resident_cell(300), yield_ms=5_000)
        assert isinstance(first, Yielded) and texts(first) == ["held"]
        # The second cell takes the total past the cap: its engine is stopped, not the larger.
        second = await start(grower, _resident_cell(120), yield_ms=10_000)
        assert isinstance(second, Result), second
        assert second.error_text == (
            f"exec cell exceeded the memory limit of {cap} bytes shared by all engine processes "
            "(its engine grew the most)"
        )
        alive = await large.wait(WaitRequest(first.cell_id, 200))
        assert isinstance(alive, LiveCell) and isinstance(alive.response, Yielded), alive
        assert texts(await completed(grower, 'text("again")')) == ["again"]
