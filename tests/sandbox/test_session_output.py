"""The output a session's cells hold for observers is bounded as a whole, not only per cell.

A cell that yields and is never waited on keeps what it buffered, and so does a completion nobody
observes: each within its own bound (16 Mi characters), but nothing bounded how many such cells
one session keeps (20 of them took the host process from 27 MiB to 1.3 GiB). Past the session's
bound the cell whose item would cross it ends as at its own bound; the others keep theirs, and an
observation (or a cell's close) gives the room back. Most tests lower the bound (items of 1,000
characters count 1,064 each); one runs at the real size.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from codemode.protocol import (
    CellId,
    ContentItem,
    InputText,
    Result,
    RuntimeResponse,
    Terminated,
    WaitRequest,
    Yielded,
)
from codemode.runtime import LocalSession, LocalSessionProvider
from codemode.runtime import cell as cell_module
from codemode.runtime.cell import ITEM_OVERHEAD_CHARS, MAX_SESSION_BUFFERED_OUTPUT_CHARS
from tests.contract.delegate import RecordingDelegate
from tests.sandbox.conftest import start

pytestmark = pytest.mark.timeout(30)

#: The lowered bound: 9 items of 1,000 characters fit (9 items of 1,064), a tenth does not.
BOUND = 10_000
ITEM = 1_000 + ITEM_OVERHEAD_CHARS
CROSSED = (
    f"exec cell output exceeds the session limit of {BOUND} characters waiting unread in all its "
    "cells"
)


@pytest.fixture
async def provider(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[LocalSessionProvider]:
    monkeypatch.setattr(cell_module, "MAX_SESSION_BUFFERED_OUTPUT_CHARS", BOUND)
    async with LocalSessionProvider() as instance:
        yield instance


def source(items: int, chars: int = 1_000, *, park: bool = True) -> str:
    """A cell that ends its initial observation at once, then buffers ``items`` texts of
    ``chars`` characters for an observer that does not come (and waits for ever, if ``park``)."""
    body = f"yield_control(); for (let i = 0; i < {items}; i++) text(String(i).repeat({chars}));"
    return body + (" await new Promise(() => {});" if park else "")


async def buffering(session: LocalSession, items: int, *, park: bool = True) -> CellId:
    """Start a cell of :func:`source` and return once its items are all buffered."""
    before = sum(cell._buffered for cell in session._cells.values())
    cell_id, response = await start(session, source(items, park=park), 60_000)
    assert response == Yielded(cell_id, [])
    await settled(session, before + items * ITEM)
    return cell_id


async def settled(session: LocalSession, chars: int) -> None:
    """Return once the session's cells have buffered ``chars`` (each cell's own count)."""
    async with asyncio.timeout(5):
        while sum(cell._buffered for cell in session._cells.values()) != chars:
            await asyncio.sleep(0.005)


async def observe(session: LocalSession, cell_id: CellId, yield_ms: int = 100) -> RuntimeResponse:
    outcome = await session.wait(WaitRequest(cell_id, yield_ms))
    return outcome.response


def items(count: int) -> list[ContentItem]:
    return [InputText(str(i) * 1_000) for i in range(count)]


async def crossing(session: LocalSession, kept: int) -> None:
    """A cell whose item ``kept + 1`` would pass the bound ends with that bound's error and the
    ``kept`` items before it."""
    cell_id, response = await start(session, source(10), 60_000)
    assert response == Yielded(cell_id, [])
    # Without the bound the cell waits for ever: the wait yields after 2 s instead.
    assert await observe(session, cell_id, 2_000) == Result(cell_id, items(kept), CROSSED)


async def test_the_cell_that_crosses_the_session_bound_ends_and_the_others_keep_theirs(
    provider: LocalSessionProvider,
) -> None:
    session = await provider.create_session(RecordingDelegate())
    first = await buffering(session, 4)
    second = await buffering(session, 4)  # each far under its own bound: 8 items of 1,064 together
    await crossing(session, 1)
    assert session.buffered_output == 8 * ITEM
    # The session goes on: the others are observed whole, and that gives the room back.
    assert await observe(session, first) == Yielded(first, items(4))
    assert await observe(session, second) == Yielded(second, items(4))
    assert session.buffered_output == 0
    third = await buffering(session, 9)
    assert await observe(session, third) == Yielded(third, items(9))


async def test_an_unobserved_completion_counts_until_observed(
    provider: LocalSessionProvider,
) -> None:
    session = await provider.create_session(RecordingDelegate())
    done = await buffering(session, 8, park=False)
    await crossing(session, 1)
    assert await observe(session, done) == Result(done, items(8))  # closed: room again
    assert session.buffered_output == 0
    await crossing(session, 9)


async def test_an_unobserved_error_text_counts_and_is_cut_to_the_room_left(
    provider: LocalSessionProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An error text is held until observed as items are: many cells ending unobserved with
    # 16 Mi-character errors passed the session's bound uncounted.
    monkeypatch.setattr(cell_module, "MIN_ERROR_TEXT_ROOM", 100)
    session = await provider.create_session(RecordingDelegate())
    await buffering(session, 9)
    cell_id, response = await start(
        session, "yield_control(); throw 'e'.repeat(5000)", yield_ms=60_000
    )
    assert response == Yielded(cell_id, [])
    room = BOUND - 9 * ITEM
    async with asyncio.timeout(5):
        while session.buffered_output < BOUND:
            await asyncio.sleep(0.005)
    note = "\n… (error text cut: 5000 characters in all)"
    assert session.buffered_output == BOUND + len(note)
    outcome = await observe(session, cell_id)
    assert isinstance(outcome, Result)
    assert outcome.error_text == "e" * room + note
    assert session.buffered_output == 9 * ITEM  # observed: its room is back


async def test_a_terminated_cell_gives_its_room_back(provider: LocalSessionProvider) -> None:
    session = await provider.create_session(RecordingDelegate())
    parked = await buffering(session, 8)
    await crossing(session, 1)
    outcome = await asyncio.wait_for(session.terminate(parked), 5)
    assert outcome.response == Terminated(parked, items(8))
    assert session.buffered_output == 0
    await crossing(session, 9)


async def test_another_session_has_a_bound_of_its_own(provider: LocalSessionProvider) -> None:
    full = await provider.create_session(RecordingDelegate())
    other = await provider.create_session(RecordingDelegate())
    await buffering(full, 8)
    kept = await buffering(other, 8)
    await crossing(full, 1)
    await crossing(other, 1)
    assert await observe(other, kept) == Yielded(kept, items(8))


async def test_a_terminating_cells_items_count_and_stop_at_the_bound(
    provider: LocalSessionProvider,
) -> None:
    # An item that comes while its cell terminates belongs to its `Terminated`, counted like any
    # other, and is not taken past the session's bound (the engine is untrusted: it may go on
    # sending after the stop).
    session = await provider.create_session(RecordingDelegate())
    await buffering(session, 8)
    cell_id = await buffering(session, 0)
    cell = session._cells[cell_id]
    cell._state = cell_module._State.TERMINATING
    try:
        for chunk in items(3):
            cell.on_item(chunk)
    finally:
        cell._state = cell_module._State.RUNNING
    assert session.buffered_output == 9 * ITEM
    outcome = await asyncio.wait_for(session.terminate(cell_id), 5)
    assert outcome.response == Terminated(cell_id, items(1))
    assert session.buffered_output == 8 * ITEM


async def test_items_an_observer_left_behind_count_again(provider: LocalSessionProvider) -> None:
    # A wait cancelled after its outcome was set puts the items back (`Cell._undeliver`): they
    # count again, for the cell's own bound and the session's.
    session = await provider.create_session(RecordingDelegate())
    cell_id = await buffering(session, 8)
    waiting = asyncio.ensure_future(session.wait(WaitRequest(cell_id, 0)))
    await asyncio.sleep(0)  # attached: the 0 ms yield set its outcome; it has not returned yet
    assert session.buffered_output == 0
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert session._cells[cell_id]._buffered == 8 * ITEM
    assert session.buffered_output == 8 * ITEM
    await crossing(session, 1)
    assert await observe(session, cell_id) == Yielded(cell_id, items(8))
    assert session.buffered_output == 0


@pytest.mark.slow
async def test_the_real_bound_takes_four_cells_at_their_own_limit() -> None:
    # Each cell buffers exactly its own limit (4 items of 4 Mi characters with their overhead):
    # four fill the session's bound exactly, and the fifth's first item would pass it.
    chars = (4 << 20) - ITEM_OVERHEAD_CHARS
    fill = f"yield_control(); const s = 'x'.repeat({chars}); for (let i = 0; i < 4; i++) text(s);"
    message = (
        "exec cell output exceeds the session limit of 67108864 characters waiting unread in all "
        "its cells"
    )
    assert MAX_SESSION_BUFFERED_OUTPUT_CHARS == 4 * cell_module.MAX_BUFFERED_OUTPUT_CHARS
    async with LocalSessionProvider() as provider:
        session = await provider.create_session(RecordingDelegate())
        for expected in range(1, 5):
            cell_id, response = await start(session, fill + "await new Promise(() => {});", 60_000)
            assert response == Yielded(cell_id, [])
            await settled(session, expected * 16 << 20)
        cell_id, response = await start(session, fill, 60_000)
        assert response == Yielded(cell_id, [])
        assert await observe(session, cell_id, 5_000) == Result(cell_id, [], message)
        assert session.buffered_output == MAX_SESSION_BUFFERED_OUTPUT_CHARS
