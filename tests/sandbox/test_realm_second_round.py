"""A second red-team round against the realm and the cell API (the first: ``test_realm.py``,
``test_attacks_sweep.py``, ``tests/runtime/test_limits.py``).

Each test pins one finding and fails without its fix:

* ``exit()`` could be caught: the prelude ends the cell by throwing a value, and `done` went out only
  when the isolate's turn ended. A cell that caught it in a loop (``for (;;) try { exit() } catch
  {}``), or spun in a ``finally``, never ended its turn: the cell ran on (spinning a CPU) and
  reported ``Yielded`` instead of its ``Result`` (runtime.md §9: no code of the cell runs after
  ``exit()``; upstream 0.171.0 answers ``Result`` at once). Now the host sends `done` at once and
  stops the isolate.
* the engine's main thread (which alone can stop a cell) scanned ahead from every ``import(`` of a
  cell's source to its closing parenthesis, with a lexer that a regular expression fools: a source
  of many ``import(/\\(/)`` took quadratic time there (a 280 kB cell: 15 s, a 1 MB one minutes), while
  no termination could be handled. Now each is decided in the one linear pass.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest

from codemode.protocol import InputText, Result, RuntimeResponse
from codemode.runtime import LocalSession, LocalSessionProvider
from tests.contract.delegate import RecordingDelegate
from tests.sandbox.conftest import start

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def session() -> AsyncIterator[LocalSession]:
    async with LocalSessionProvider() as provider:
        yield await provider.create_session(RecordingDelegate())


async def ends(session: LocalSession, source: str, yield_ms: int = 3_000) -> Result:
    """The cell's Result; a cell still running after ``yield_ms`` is stopped and fails the test."""
    cell_id, response = await start(session, source, yield_ms)
    if not isinstance(response, Result):
        await session.terminate(cell_id)
        pytest.fail(f"the cell did not end: {response!r}")
    return response


def texts(response: RuntimeResponse) -> list[str]:
    return [item.text for item in response.content_items if isinstance(item, InputText)]


# -- exit() cannot be caught ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "source",
    [
        "text('a');\nfor (;;) { try { exit(); } catch (e) {} }",
        "text('a');\ntry { exit(); } finally { for (;;) {} }",
        # exit() inside a helper's hook: the helper turns what it threw into its own text.
        "text('a');\nfor (;;) { try { text({toJSON() { exit(); }}); } catch (e) {} }",
    ],
    ids=["catch_in_a_loop", "finally", "inside_to_json"],
)
async def test_exit_ends_the_cell_whatever_catches_it(session: LocalSession, source: str) -> None:
    result = await ends(session, source)
    assert result.error_text is None
    assert texts(result) == ["a"]
    # The session's next cell runs as usual.
    assert texts(await ends(session, "text('next')")) == ["next"]


async def test_exit_after_the_end_stops_the_leftover_microtasks(session: LocalSession) -> None:
    # The body ends; a microtask it left stores (committed, as upstream) and then catches exit()
    # in a loop: the cell still ends, with that write.
    source = (
        "text('a');\n"
        "let p = Promise.resolve();\n"
        "for (let i = 0; i < 30; i++) p = p.then(() => {});\n"
        "p.then(() => { store('late', 2); for (;;) { try { exit(); } catch (e) {} } });\n"
    )
    result = await ends(session, source)
    assert result.error_text is None
    assert texts(result) == ["a"]
    assert texts(await ends(session, "text(String(load('late')))")) == ["2"]


# -- the engine's main thread reads a cell's source in linear time --------------------------------


async def test_dynamic_import_renaming_is_linear(session: LocalSession) -> None:
    # Each `import(/\(/)` hid a `(` from the scan ahead that looked for its closing parenthesis,
    # so every scan ran to the source's end. The engine's main thread was stalled for seconds,
    # unable to handle a termination (or anything else of the session).
    source = "text('start');\nif (0) {\n" + "import(/\\(/);\n" * 20_000 + "}\ntext('end');\n"
    began = time.monotonic()
    result = await ends(session, source, yield_ms=5_000)
    assert time.monotonic() - began < 5
    assert result.error_text is None
    assert texts(result) == ["start", "end"]
    # Methods named `import` are still no imports; calls still are.
    result = await ends(
        session,
        "const o = { import(x) { return 'm' + x; } };\n"
        "class C { static import() { return 's'; } get import() { return 'g'; } }\n"
        "text(o.import(1) + C.import() + new C().import);\n"
        "try { await import(/\\(/); } catch (e) { text(String(e)); }\n"
        "try { await import /* c */ (`x${(1)}`); } catch (e) { text(String(e)); }\n",
    )
    assert texts(result) == ["m1sg", "unsupported import in exec", "unsupported import in exec"]
