"""Runtime fidelity: what the model would see, our runtime beside the upstream host.

Each cell runs in a fresh session on the embedded runtime and on the upstream host binary (our V1
client; ``tests/upstream.py`` fetches it once, the test skips without it). The results — kind of
response, items, error text — must be equal, except for the cases in ``DIFFERENCES``, each with its
reason (also listed in ``docs/interop.md``).
"""

from __future__ import annotations

import pytest

from codemode.client import ProcessOwnedCodeModeSessionProvider
from codemode.protocol import (
    CodeModeSessionProvider,
    ExecuteRequest,
    InputAudio,
    InputImage,
    InputText,
    RuntimeResponse,
)
from codemode.runtime import LocalSessionProvider
from tests.contract.delegate import FIXTURE_TOOLS, RecordingDelegate
from tests.upstream import unavailable_reason, upstream_host

CELLS = [
    'text(1); text("a"); text(true); text(null); text(undefined); text(10n); text(1.5e300); text(-0); text(NaN)',
    'text({a: 1, b: [1, "x", null]}); text([1, [2, [3]]]); text(new Date(0)); text(/re/g); text(new Map([[1,2]]))',
    'text(Symbol("s"))',
    "const o = {}; o.self = o; text(o)",
    "text({big: 1n})",
    'text({toJSON() { return "custom" }}); text({toJSON() { return undefined }})',
    'text("a\\ud800b")',
    "text()",
    'text("x", "y")',
    'notify("")',
    'notify("  ")',
    'notify(42); text("ok")',
    "image(5)",
    "image({image_url: 5})",
    'image("data:image/png;base64,AAA", "LOW"); image("data:image/png;base64,AAA", "bogus")',
    'image("https://example.com/a.png")',
    'image({type: "text", text: "x"})',
    'image({type: "image", data: "AAA", mimeType: "image/jpeg"})',
    'image("ftp://x")',
    'audio("data:audio/wav;base64,AAA")',
    'generatedImage({image_url: "data:image/png;base64,AAA", output_hint: "hint"})',
    'generatedImage("x")',
    "store();",
    'store("k", 1n)',
    'store("k", {a: 1}); text(JSON.stringify(load("k"))); text(String(load("nope")))',
    'store(7, "seven"); text(load("7"))',
    'store({toString() { return "obj" }}, 1); text(String(load("obj")))',
    "setTimeout(5)",
    'setTimeout(() => text("t"), "abc"); await new Promise(r => setTimeout(r, 5))',
    "text(String(setTimeout(() => {}, 1))); text(String(setTimeout(() => {}, 1)))",
    "clearTimeout(1n)",
    'clearTimeout({}); clearTimeout(-5); clearTimeout(Infinity); text("ok")',
    'throw new TypeError("bad")',
    'throw "plain"',
    "throw {a: 1}",
    'throw {stack: "fake stack"}',
    "throw null",
    "throw undefined",
    "throw 42",
    'await Promise.reject(new RangeError("r"))',
    'await Promise.reject("s")',
    "null.x",
    "undefinedVariable",
    "const x = ;",
    "let let = 1",
    'import x from "y"',
    'import("z")',
    'await import("z")',
    "export const q = 1",
    "text(typeof console); text(typeof require); text(typeof process); text(typeof globalThis.fetch); text(typeof setInterval)",
    "text(typeof WebAssembly); text(typeof SharedArrayBuffer); text(typeof Atomics); text(typeof queueMicrotask); text(typeof structuredClone)",
    'text(Object.keys(globalThis).join(","))',
    'text(Object.getOwnPropertyNames(globalThis).filter(n => !/^[A-Z]/.test(n)).sort().join(","))',
    'text(typeof tools); text(Object.keys(tools).sort().join(",")); text(JSON.stringify(ALL_TOOLS.map(t => t.name)))',
    "text(JSON.stringify(await tools.echo({a: 1})))",
    "try { await tools.fail({}) } catch (e) { text(typeof e); text(String(e)) }",
    "await tools.fail({})",
    'text(JSON.stringify(await tools.patch("raw text")))',
    "text(JSON.stringify(await tools.echo()))",
    "await tools.echo(() => 1)",
    "await tools.echo({f: 1n})",
    "tools.echo = 5; text(typeof tools.echo)",
    "text = 5",
    'yield_control(); text("after")',
    'exit(); text("no")',
    'text("before"); exit()',
    'text(this === undefined ? "undef" : typeof this)',
    "text(typeof arguments)",
    "return 5",
    "text(String(Error.prepareStackTrace)); text(typeof Error.captureStackTrace)",
    'function f() { return new Error("x").stack } text(f())',
    'text(new Error("m").stack)',
    "eval(\"text('evaled')\")",
    'text(String(new Function("return 1")()))',
    "text(Intl.DateTimeFormat().resolvedOptions().timeZone)",
    "text(String(Math.random() < 1)); text(String(Date.now() > 0))",
    'text("x".repeat(10))',
    "const r = await Promise.all([1,2,3].map(i => tools.echo({i}))); text(JSON.stringify(r))",
    "text(JSON.stringify(load))",
]

#: Cells whose results differ on purpose or by release (cell → why).
DIFFERENCES: dict[str, str] = {
    "store();": "0.149.0 throws `failed to serialize JavaScript value: …`; runtime.md §6 pins the "
    "later releases' `Unable to store …`",
    "const x = ;": "our syntax errors name their place (exec_main.mjs:LINE:COL)",
    "let let = 1": "our syntax errors name their place (exec_main.mjs:LINE:COL)",
    "return 5": "our syntax errors name their place (exec_main.mjs:LINE:COL)",
    "export const q = 1": "a cell runs as a function body here, so `export` is a syntax error",
    "text(typeof arguments)": "a cell runs as a function body here, so `arguments` exists",
    "await tools.echo(() => 1)": "runtime.md §4.3: a function argument means no input; 0.149.0 "
    "throws `failed to serialize JavaScript value: …`",
}

Outcome = tuple[str, list[str], str | None]


def outcome(response: RuntimeResponse) -> Outcome:
    items: list[str] = []
    for item in response.content_items:
        if isinstance(item, InputText):
            items.append(item.text)
        elif isinstance(item, InputImage):
            items.append(f"image {item.image_url} {item.detail}")
        else:
            assert isinstance(item, InputAudio)
            items.append(f"audio {item.audio_url}")
    return type(response).__name__, items, getattr(response, "error_text", None)


async def run_all(provider: CodeModeSessionProvider) -> list[Outcome]:
    results = []
    for source in CELLS:
        session = await provider.create_session(RecordingDelegate())
        started = await session.execute(
            ExecuteRequest(
                tool_call_id="c",
                source=source,
                enabled_tools=list(FIXTURE_TOOLS),
                yield_time_ms=5000,
            )
        )
        results.append(outcome(await started.initial_response()))
        await session.shutdown()
    return results


@pytest.fixture(scope="module")
def upstream() -> str:
    binary = upstream_host()
    if binary is None:
        pytest.skip(unavailable_reason())
    return str(binary)


@pytest.fixture
async def both(upstream: str) -> tuple[list[Outcome], list[Outcome]]:
    async with LocalSessionProvider() as ours:
        mine = await run_all(ours)
    async with ProcessOwnedCodeModeSessionProvider([upstream, "--listen", "stdio"]) as theirs:
        reference = await run_all(theirs)
    return mine, reference


@pytest.mark.timeout(180)
async def test_cells_read_the_same_as_on_the_upstream_host(
    both: tuple[list[Outcome], list[Outcome]],
) -> None:
    mine, reference = both
    unexpected = []
    for source, ours, theirs in zip(CELLS, mine, reference, strict=True):
        if source in DIFFERENCES:
            assert ours != theirs, f"now equal, drop it from DIFFERENCES: {source!r}"
        elif ours != theirs:
            unexpected.append(f"{source!r}:\n  ours   {ours!r}\n  theirs {theirs!r}")
    assert not unexpected, "\n".join(unexpected)
