"""Realm escapes: no object a cell can reach may lead to another JavaScript realm (and its ``process``).

Every case runs ``payload(F)`` on whatever function constructor it obtained (or harvests objects and
lets ``__probeAll`` do so) and then checks, from the outside, that no marker was written and the
secret was not read (``assert_no_escape``), and that every probe saw ``process`` undefined and no
foreign-realm object (``assert_probes_sound``). Each family runs as several variants.
"""

from __future__ import annotations

import json

import pytest

from tests.contract.delegate import RecordingDelegate
from tests.sandbox.conftest import (
    Canary,
    Harness,
    assert_no_escape,
    assert_probes_sound,
    finish,
    js,
    payload,
    probe_lines,
    texts,
)


def words(text: str) -> list[str]:
    return text.split()


HELPERS = [
    "text",
    "image",
    "generatedImage",
    "audio",
    "notify",
    "store",
    "load",
    "yield_control",
    "exit",
    "setTimeout",
    "clearTimeout",
]

#: Ways to get from a value ``{x}`` to a function constructor.
FORMS = [
    "{x}.constructor",
    "{x}.constructor.constructor",
    "Object.getPrototypeOf({x}).constructor",
    "Object.getPrototypeOf({x}).constructor.constructor",
    "{x}.__proto__.constructor",
    "{x}.__proto__.constructor.constructor",
    "Object.getPrototypeOf(Object.getPrototypeOf({x})).constructor.constructor",
    "{x}.call.constructor",
    "{x}.apply.constructor",
    "{x}.bind.constructor",
    "{x}.bind(null).constructor",
    "{x}.toString.constructor",
    "{x}.valueOf.constructor",
    "{x}.hasOwnProperty.constructor",
    "{x}.constructor.prototype.constructor",
    "{x}.prototype.constructor.constructor",
    "{x}.caller.constructor",
    "{x}.arguments.constructor.constructor",
    "Object.getOwnPropertyDescriptor({x}, 'prototype').value.constructor.constructor",
]


def forms(x: str) -> str:
    """Probe every FORM of ``x``, then harvest ``x`` (its own properties are checked too)."""
    probes = "".join(payload(form.format(x=x)) for form in FORMS)
    return f"{probes}__harvest({x});\n"


async def probe(
    harness: Harness,
    canary: Canary,
    body: str,
    *,
    end: bool = True,
    minimum: int = 1,
    timeout: float = 30.0,
    store: str = "small",
) -> None:
    """Run ``canary.cell(body)`` (plus ``__probeAll``) and check that nothing escaped.

    ``store="large"`` fills the session's store first, past what a cell is given whole: its
    ``load`` then fetches keys from the engine's main thread.
    """
    delegate = RecordingDelegate()
    session = await harness.session(delegate)
    if store == "large":
        filled = await finish(session, f"store('pad', 'p'.repeat({LARGE_STORE_CHARS}))")
        assert filled.error_text is None, filled.error_text
    source = canary.cell(body + "\n__probeAll('harvest');\n" if end else body, end=end)
    result = await finish(session, source, timeout=timeout)
    assert_no_escape(canary, result, delegate)
    assert_probes_sound(result, end=end, minimum=minimum)


#: More than the runtime gives a cell whole (64 Ki characters).
LARGE_STORE_CHARS = 80 * 1024
STORES = ["small", "large"]


# -- 1. the global object and its prototype chain ------------------------------------------------

GLOBAL_FORMS = [
    "globalThis.constructor.constructor",
    "globalThis.constructor",
    "Object.getPrototypeOf(globalThis).constructor.constructor",
    "Object.getPrototypeOf(Object.getPrototypeOf(globalThis)).constructor.constructor",
    "globalThis.__proto__.constructor.constructor",
    "globalThis.__proto__.__proto__.constructor.constructor",
    "Function('return this')().constructor.constructor",
    "new Function('return this')().constructor.constructor",
    "Function('return this')().__proto__.constructor.constructor",
    "Function('return (function () { return this })()')().constructor.constructor",
    "this.constructor.constructor",
    "(0, eval)('this').constructor.constructor",
    "(0, eval)('globalThis').constructor.constructor",
    "Object.getOwnPropertyDescriptor(globalThis, 'globalThis').value.constructor.constructor",
    "Object(globalThis).constructor.constructor",
    "globalThis.valueOf().constructor.constructor",
    "globalThis.toString.constructor",
    "globalThis.hasOwnProperty.constructor",
    "globalThis.__lookupGetter__('__proto__').constructor",
    "globalThis.constructor.prototype.constructor.constructor",
    "new globalThis.constructor().constructor.constructor",
    "globalThis.constructor.getPrototypeOf(globalThis).constructor.constructor",
    "Reflect.getPrototypeOf(globalThis).constructor.constructor",
    "Object.getOwnPropertyDescriptor(Object.getPrototypeOf(globalThis), 'constructor').value.constructor",
]


@pytest.mark.parametrize("form", GLOBAL_FORMS)
async def test_global_object(harness: Harness, canary: Canary, form: str) -> None:
    await probe(harness, canary, payload(form))


async def test_global_prototype_chain_walk(harness: Harness, canary: Canary) -> None:
    # Every object on the global's prototype chain, every property on each, getters included.
    body = """
let level = globalThis;
for (let depth = 0; level !== null && depth < 32; depth++) {
  __harvest(level);
  __probe('chain' + depth + '.constructor.constructor', () => level.constructor.constructor);
  for (const key of Reflect.ownKeys(level)) {
    const d = Reflect.getOwnPropertyDescriptor(level, key);
    if (d === undefined) continue;
    __harvest(d.value); __harvest(d.get); __harvest(d.set);
  }
  level = Object.getPrototypeOf(level);
}
"""
    await probe(harness, canary, body)


async def test_every_global_value(harness: Harness, canary: Canary) -> None:
    # Every own global (standard built-ins and the installed helpers) and everything one level down.
    body = """
for (const key of Reflect.ownKeys(globalThis)) {
  const d = Reflect.getOwnPropertyDescriptor(globalThis, key);
  if (d === undefined) continue;
  for (const v of [d.value, d.get, d.set]) {
    if (v === null || (typeof v !== 'object' && typeof v !== 'function')) continue;
    __probe('global ' + String(key) + '.constructor.constructor', () => v.constructor.constructor);
    __probe('global ' + String(key) + '.[[Prototype]].constructor.constructor',
            () => Object.getPrototypeOf(v).constructor.constructor);
  }
}
"""
    await probe(harness, canary, body, minimum=20)


#: Globals a cell may see: standard ECMAScript (and V8) built-ins and the runtime's own helpers
#: (runtime.md §3). §3.2: no Node, browser or Deno API, and a binding MUST NOT inject any.
STANDARD_GLOBALS = {
    *words(
        "AggregateError Array ArrayBuffer AsyncDisposableStack Atomics BigInt BigInt64Array "
        "BigUint64Array Boolean DataView Date DisposableStack Error EvalError FinalizationRegistry "
        "Float16Array Float32Array Float64Array Function Infinity Int16Array Int32Array Int8Array Intl "
        "Iterator JSON Map Math NaN Number Object Promise Proxy RangeError ReferenceError Reflect RegExp "
        "Set SharedArrayBuffer String SuppressedError Symbol SyntaxError TypeError URIError Uint16Array "
        "Uint32Array Uint8Array Uint8ClampedArray WeakMap WeakRef WeakSet WebAssembly console decodeURI "
        "decodeURIComponent encodeURI encodeURIComponent escape eval globalThis isFinite isNaN "
        "parseFloat parseInt undefined unescape Temporal ShadowRealm AsyncIterator"
    ),
}
INSTALLED_GLOBALS = {*HELPERS, "tools", "ALL_TOOLS"}


async def test_no_injected_globals(harness: Harness, canary: Canary) -> None:
    session = await harness.session()
    result = await finish(
        session,
        "const names = [];\n"
        "for (let o = globalThis; o !== null && o !== Object.prototype; o = Object.getPrototypeOf(o))\n"
        "  for (const k of Reflect.ownKeys(o)) names.push(String(k));\n"
        "text(JSON.stringify(names))",
    )
    assert_no_escape(canary, result)
    assert result.error_text is None, result.error_text
    names = set(json.loads(texts(result)[0]))
    extra = names - STANDARD_GLOBALS - INSTALLED_GLOBALS - {"constructor"}
    assert extra == set(), f"globals a binding injected: {sorted(extra)}"


# -- 2. everything the runtime installs ----------------------------------------------------------


@pytest.mark.parametrize("helper", HELPERS)
async def test_helper_function(harness: Harness, canary: Canary, helper: str) -> None:
    body = forms(helper) + payload(
        f"Object.getOwnPropertyDescriptor(globalThis, {js(helper)}).value.constructor.constructor"
    )
    await probe(harness, canary, body)


TOOLS_VALUES = [
    "tools",
    "tools.echo",
    "tools.patch",
    "tools.fail",
    "tools.hidden_dynamic_tool",
    "ALL_TOOLS",
    "ALL_TOOLS[0]",
    "ALL_TOOLS[0].name",
    *(
        f"tools[{js(name)}]"
        for name in (
            "constructor",
            "__proto__",
            "then",
            "toString",
            "valueOf",
            "hasOwnProperty",
            "call",
            "apply",
            "bind",
            "prototype",
            "caller",
            "arguments",
            "__defineGetter__",
            "missing_tool",
        )
    ),
]


@pytest.mark.parametrize("value", TOOLS_VALUES)
async def test_tools_objects(harness: Harness, canary: Canary, value: str) -> None:
    body = forms(value) + (
        "for (const k of Reflect.ownKeys(tools)) __harvest(tools[k]);\n"
        "for (const t of ALL_TOOLS) __harvest(t);\n"
    )
    await probe(harness, canary, body)


async def test_tool_call_promise_and_returned_values(harness: Harness, canary: Canary) -> None:
    body = (
        "const pr = tools.echo({a: {b: [1, {c: 'd'}]}, e: [[]], s: 'x'});\n"
        + forms("pr")
        + forms("pr.then")
        + "const v = await pr;\n"
        + "".join(forms(x) for x in ("v", "v.a", "v.a.b", "v.a.b[1]", "v.e", "v.e[0]", "v.s"))
        + "const none = await tools.echo();\n"
        + forms("none")
        + "const patched = await tools.patch('x');\n"
        + forms("patched")
        + "const both = await Promise.all([tools.echo({i: 1}), tools.hidden_dynamic_tool({})]);\n"
        + forms("both")
        + forms("both[1]")
    )
    await probe(harness, canary, body)


async def test_timer_ids_load_results_and_helper_return_values(
    harness: Harness, canary: Canary
) -> None:
    body = (
        "const id = setTimeout(() => {}, 1e6);\n"
        + forms("id")
        + "clearTimeout(id);\n"
        + "store('k', {a: [{b: 1}], s: 's'});\n"
        + "const l = load('k');\n"
        + "".join(forms(x) for x in ("l", "l.a", "l.a[0]", "l.s"))
        + "const returned = [text('r'), image(__P), notify('n'), store('q', 1), load('q'),\n"
        "  setTimeout(() => {}, 1e6), clearTimeout(1), audio('data:audio/mpeg;base64,AAAA'),\n"
        "  generatedImage({image_url: __P})];\n"
        + "".join(forms(f"returned[{i}]") for i in range(9))
        + "const y = yield_control();\n"
        + forms("y")
        + "const awaited = await y;\n"
        + forms("awaited")
    )
    await probe(harness, canary, body)


# -- 3. errors thrown by helpers and tool rejections ----------------------------------------------

MISUSES: dict[str, list[str]] = {
    "image": [
        "image(5)",
        "image('')",
        "image()",
        "image(null)",
        "image(Symbol('s'))",
        "image('https://example.com/a.png')",
        "image('ftp://x/a.png')",
        "image(__P, 5)",
        "image(__P, 'medium')",
        "image({image_url: 5})",
        "image({image_url: __P, detail: {}})",
        "image({type: 'text', text: 'x'})",
        "image({type: 'image', data: ''})",
        "image([])",
    ],
    "generatedImage_audio": [
        "generatedImage(5)",
        "generatedImage({image_url: __P, output_hint: 3})",
        "generatedImage({image_url: 'https://x/y.png'})",
        "audio(5)",
        "audio('')",
        "audio({type: 'image', data: 'AAA'})",
        "audio({type: 'audio', data: ''})",
        "audio('https://x/a.wav')",
    ],
    "store_load": [
        "store('f', () => 1)",
        "store('b', 10n)",
        "(() => { const c = {}; c.c = c; store('c', c); })()",
        "store('u')",
        "store('s', Symbol('s'))",
        "store(Symbol('k'), 1)",
        "load(Symbol('k'))",
        "store('r', {'$serde_json::private::RawValue': 1})",
        "store({toString() { throw new Error('key'); }}, 1)",
        "(() => { let d = []; for (let i = 0; i < 100000; i++) d = [d]; store('deep', d); })()",
    ],
    "notify_text": [
        "notify('')",
        "notify('   ')",
        "notify(Symbol('s'))",
        "(() => { const c = {}; c.c = c; notify(c); })()",
        "(() => { const c = {}; c.c = c; text(c); })()",
        "text({toJSON() { throw new Error('toJSON'); }})",
        "text({toJSON() { throw {weird: true}; }})",
        "text({get x() { throw new TypeError('getter'); }})",
        "(() => { let d = []; for (let i = 0; i < 100000; i++) d = [d]; text(d); })()",
    ],
    "timers": [
        "clearTimeout(Symbol())",
        "clearTimeout(10n)",
        "clearTimeout('abc')",
        "setTimeout('text(1)', 0)",
        "setTimeout()",
        "setTimeout(() => {}, Symbol())",
        "setTimeout(() => {}, 10n)",
    ],
    "tools_sync": [
        "(() => { const c = {}; c.c = c; tools.echo(c); })()",
        "tools.echo(10n)",
        "tools.echo({toJSON() { throw new Error('arg'); }})",
        "tools.nope({})",
        "tools.patch(Symbol())",
    ],
    "constructors_and_receivers": [
        "new text('x')",
        "new image(__P)",
        "new tools.echo({})",
        "Reflect.construct(notify, ['x'])",
        "Reflect.construct(setTimeout, [() => {}, 0])",
        "text.call(5, (() => { const c = {}; c.c = c; return c; })())",
        "image.apply({}, [5])",
        "store.call(null, Symbol())",
        "tools.echo.call(globalThis, 10n)",
    ],
}

ASYNC_MISUSES = [
    "tools.fail({})",
    "tools.echo('x')",
    "tools.patch({a: 1})",
    "tools.fail()",
    "Promise.all([tools.fail({}), tools.fail({})])",
    "Promise.any([tools.fail({}), tools.fail({})])",
    "tools.fail({}).finally(() => {})",
    "tools.fail({}).then(null, (e) => { throw e; })",
    "import('fs')",
]


def _sync_misuse(index: int, expression: str) -> str:
    return (
        f"try {{ __keep({expression}); __text('no throw: ' + {js(expression)}); }} catch (e{index}) {{\n"
        f"  __harvest(e{index});\n"
        f"  {payload(f'e{index}.constructor.constructor', f'{expression} -> e.constructor.constructor')}"
        f"  {payload(f'Object.getPrototypeOf(e{index}).constructor.constructor', f'{expression} -> [[Prototype]]')}"
        f"  {payload(f'e{index}.__proto__.constructor.constructor', f'{expression} -> __proto__')}"
        "}\n"
    )


@pytest.mark.parametrize("group", sorted(MISUSES))
async def test_helper_errors(harness: Harness, canary: Canary, group: str) -> None:
    body = "".join(_sync_misuse(i, expr) for i, expr in enumerate(MISUSES[group]))
    await probe(harness, canary, body)


async def test_tool_rejections(harness: Harness, canary: Canary) -> None:
    body = ""
    for i, expression in enumerate(ASYNC_MISUSES):
        body += (
            f"try {{ await {expression}; }} catch (r{i}) {{\n"
            f"  __harvest(r{i});\n"
            f"  {payload(f'r{i}.constructor.constructor', f'{expression} -> reason.constructor.constructor')}"
            "}\n"
            f"await {expression}.catch((reason) => {{ __harvest(reason); }});\n"
            f"await {expression}.then(null, function (reason) {{ __harvest(reason); __harvest(this); }});\n"
        )
    await probe(harness, canary, body)


# -- 4. stack overflow that fires inside a helper ---------------------------------------------------

_OVERFLOW = """
function __rec(n, fn, a, b, c, d, e, f, g, h) {
  if (n <= 0) return fn();
  return __rec(n - 1, fn, b, c, d, e, f, g, h, a) + 0;
}
const __keepAlive = [];
let __reached = false;
let __returned;
const __call = () => {
  __reached = true;
  __returned = (%(call)s); // only an assignment here: nothing that could overflow on its own
};
// Did the helper get called at recursion depth d? (else the overflow came first)
function __reaches(d) {
  __reached = false;
  __returned = undefined;
  try { __rec(d, __call); } catch (e) { __harvest(e); }
  if (__isObj(__returned) && typeof __returned.then === 'function') __keepAlive.push(__keep(__returned));
  return __reached;
}
// The deepest depth at which the helper is still reached: there it has the least stack left.
function __top() {
  let lo = 0, hi = 64;
  while (hi < 1e7 && __reaches(hi)) { lo = hi; hi *= 2; }
  while (hi - lo > 1) { const mid = (lo + hi) >> 1; if (__reaches(mid)) lo = mid; else hi = mid; }
  return lo;
}
// Frame sizes change as __rec gets optimized: measure again before every sweep.
for (let round = 0; round < 2; round++) {
  const top = __top();
  for (let d = top + 4; d >= 0 && d > top - %(width)d; d--) __reaches(d);
}
await Promise.allSettled(__keepAlive);
"""

OVERFLOW_CALLS = {
    "text": "text('x')",
    "text_object": "text({a: [1, 2, {b: 'c'}]})",
    "image": "image(__P)",
    "image_error": "image(5)",
    "generatedImage": "generatedImage({image_url: __P, output_hint: 'h'})",
    "audio": "audio('data:audio/mpeg;base64,AAAA')",
    "notify": "notify('n')",
    "store": "store('k', {a: [1, 2, 3]})",
    "store_error": "store('f', () => 1)",
    "load": "load('k')",
    "setTimeout": "setTimeout(() => {}, 1e6)",
    "clearTimeout": "clearTimeout(999)",
    "tools_echo": "tools.echo({a: 1})",
    "tools_fail": "tools.fail({})",
    "yield_control": "yield_control()",
}


# The sweep probes the engine's realm (prelude and host.js), the same code behind every carrier:
# every helper embedded; over stdio only the helpers whose call leaves through the carrier at the
# moment of the overflow (a nested call, a notification, a yield). The whole sweep over stdio
# repeated the embedded one for ~45 s of the suite's time budget.
OVERFLOW_OVER_STDIO = ("notify", "tools_echo", "yield_control")


@pytest.mark.parametrize(
    ("harness", "helper"),
    [("embedded", helper) for helper in sorted(OVERFLOW_CALLS)]
    + [("stdio", helper) for helper in OVERFLOW_OVER_STDIO],
    indirect=["harness"],
)
async def test_stack_overflow_inside_helper(harness: Harness, canary: Canary, helper: str) -> None:
    body = _OVERFLOW % {"call": OVERFLOW_CALLS[helper], "width": 200}
    await probe(harness, canary, body, timeout=45)


# -- 5. hostile arguments ------------------------------------------------------------------------

#: Every helper and tool called with ``{h}`` in each argument position.
HOSTILE_CALLS = [
    "text({h})",
    "text([{h}])",
    "text({{nested: {h}}})",
    "image({h})",
    "image(__P, {h})",
    "image({{image_url: {h}}})",
    "image({{image_url: __P, detail: {h}}})",
    "image({{type: 'image', data: 'AAA', mimeType: {h}, _meta: {h}}})",
    "generatedImage({h})",
    "generatedImage({{image_url: __P, output_hint: {h}}})",
    "audio({h})",
    "audio({{audio_url: {h}}})",
    "notify({h})",
    "store({h}, 1)",
    "store('hostile', {h})",
    "store('hostile', {{a: [{h}]}})",
    "load({h})",
    "setTimeout(() => {{}}, {h})",
    "clearTimeout({h})",
    "tools.echo({h})",
    "tools.echo({{a: {h}}})",
    "tools.patch({h})",
    "tools[{h}]",
]


def _hostile_calls(value: str) -> str:
    lines = [
        f"try {{ __keep({call.format(h=value)}); }} catch (e) {{ __harvest(e); }}"
        for call in HOSTILE_CALLS
    ]
    return "\n".join(lines) + "\nawait new Promise((r) => setTimeout(r, 5));\n"


HOSTILE_VALUES = {
    "proxy_object": "new Proxy({}, __spyHandler())",
    "proxy_array": "new Proxy([__P], __spyHandler())",
    "proxy_function": "new Proxy(function () {}, __spyHandler())",
    "proxy_of_proxy": "new Proxy(new Proxy({}, __spyHandler()), __spyHandler())",
    "proxy_handler_proxy": (
        "new Proxy({}, new Proxy({}, {get: (t, name) => __mkSpy(Reflect[name])}))"
    ),
    "coercion_hooks": "__hostile(__P)",
    "coercion_hooks_text": "__hostile('text')",
    "sloppy_getter_object": (
        "Object.defineProperties({}, {image_url: {get: __fn('__harvest(this); "
        '__harvest(arguments.callee.caller); return "data:image/png;base64,AAA"\'), '
        "enumerable: true}, a: {get: __fn('__harvest(this); __harvest(arguments.callee.caller); "
        "return 1'), enumerable: true}})"
    ),
    "array_with_getter": (
        "Object.defineProperty([1, 2], 1, {get: __mkSpy(() => 2), enumerable: true})"
    ),
    "prototype_is_proxy": "Object.create(new Proxy({}, __spyHandler()))",
}


@pytest.mark.parametrize("value", sorted(HOSTILE_VALUES))
async def test_hostile_arguments(harness: Harness, canary: Canary, value: str) -> None:
    body = f"const hostile = {HOSTILE_VALUES[value]};\n" + _hostile_calls("hostile")
    await probe(harness, canary, body)


@pytest.mark.parametrize("store", STORES)
async def test_prepare_stack_trace_frames(harness: Harness, canary: Canary, store: str) -> None:
    # Every structured stack trace that passes through a helper or a tool call: the receivers and
    # functions of its frames must all be this realm's (V8 hides them for strict frames).
    body = (
        """
Error.stackTraceLimit = Infinity;
const __frames = (e, frames) => {
  __harvest(e);
  for (let i = 0; i < frames.length; i++) {
    const f = frames[i];
    __harvest(f);
    try { __harvest(f.getThis()); } catch (x) { __harvest(x); }
    try { __harvest(f.getFunction()); } catch (x) { __harvest(x); }
    try { __harvest(f.getEvalOrigin && f.getEvalOrigin()); } catch (x) { __harvest(x); }
  }
  return 'trace';
};
Error.prepareStackTrace = __frames;
const capturing = () => { const o = {}; Error.captureStackTrace(o); o.stack; return __P; };
const traced = {toJSON: () => { new Error('inside').stack; return 'x'; }};
const steps = [
  () => text({toJSON() { return new Error('toJSON').stack; }}),
  () => text(traced), () => notify(traced), () => store('t', traced), () => __keep(tools.echo(traced)),
  () => image({get image_url() { return capturing(); }}),
  () => generatedImage({get image_url() { return capturing(); }, output_hint: 'h'}),
  () => audio({get audio_url() { capturing(); return 'data:audio/mpeg;base64,AAAA'; }}),
  () => setTimeout(() => {}, {valueOf() { capturing(); return 1e6; }}),
  () => clearTimeout({valueOf() { capturing(); return 1; }}),
  () => load({toString() { capturing(); return 'k'; }}),
  () => { const c = {}; c.c = c; text(c); }, () => { const c = {}; c.c = c; tools.echo(c); },
  () => store('b', 10n), () => image(5), () => tools.nope(),
];
for (const step of steps) {
  try { step(); } catch (e) { __harvest(e); try { e.stack; } catch (x) {} }
}
try { await tools.fail({}); } catch (e) { __harvest(e); }
try { await import('fs'); } catch (e) { __harvest(e); try { e.stack; } catch (x) {} }
await __exercise();
"""
        + "Error.stackTraceLimit = 64;\n"
        + _OVERFLOW % {"call": "text({toJSON() { return new Error('deep').stack; }})", "width": 200}
        + "Error.prepareStackTrace = undefined;\n"
    )
    await probe(harness, canary, body, timeout=45, store=store)


async def test_prepare_stack_trace_on_the_uncaught_error(harness: Harness, canary: Canary) -> None:
    # The engine formats the cell's own uncaught error: the frames it sees then are probed at once.
    body = """
Error.stackTraceLimit = Infinity;
Error.prepareStackTrace = (e, frames) => {
  for (const f of frames) {
    try { __harvest(f.getThis()); } catch (x) {}
    try { __harvest(f.getFunction()); } catch (x) {}
  }
  __harvest(e);
  __probeAll('uncaught');
  return 'formatted';
};
await Promise.resolve();
throw new Error('uncaught');
"""
    delegate = RecordingDelegate()
    session = await harness.session(delegate)
    result = await finish(session, canary.cell(body, end=False))
    assert_no_escape(canary, result, delegate)
    assert_probes_sound(result, end=False)
    assert result.error_text is not None


#: Built-ins the runtime might use, by group; every key is swapped for a spy (absent keys become
#: accessors that read as absent), then every helper and tool is called.
_SYMBOLS = ("Symbol.iterator", "Symbol.species", "Symbol.toPrimitive", "Symbol.toStringTag")
OVERRIDES: dict[str, tuple[str, list[str]]] = {
    "string_methods": (
        "String.prototype",
        words(
            "toLowerCase toUpperCase split slice substring substr indexOf lastIndexOf trim trimStart "
            "trimEnd replace replaceAll startsWith endsWith includes charAt charCodeAt codePointAt "
            "normalize concat toString valueOf at padStart repeat match localeCompare "
            "Symbol.iterator"
        ),
    ),
    "array_methods": (
        "Array.prototype",
        words(
            "includes push pop shift unshift join map forEach filter slice splice indexOf concat "
            "entries keys values reduce some every find findIndex flat sort fill at "
            "Symbol.iterator"
        ),
    ),
    "array_statics": ("Array", words("from of isArray Symbol.species")),
    "json": ("JSON", ["stringify", "parse"]),
    "object_statics": (
        "Object",
        words(
            "keys values entries assign freeze isFrozen defineProperty defineProperties "
            "getOwnPropertyNames getOwnPropertyDescriptor getOwnPropertyDescriptors hasOwn create "
            "setPrototypeOf fromEntries is seal preventExtensions"
        ),
    ),
    "object_prototype_methods": (
        "Object.prototype",
        words(
            "toString hasOwnProperty valueOf isPrototypeOf propertyIsEnumerable toLocaleString "
            "__proto__ __defineGetter__ __lookupGetter__"
        ),
    ),
    # 'value' comes last: an accessor named 'value' on Object.prototype turns every descriptor
    # object into one with a 'value', so nothing can be defined after it.
    "object_prototype_accessors": (
        "Object.prototype",
        words(
            "then t cell 0 1 type id ok error result message name stack data detail image_url "
            "audio_url output_hint text items tool input args call resolve reject done json writes "
            "config host key kind cause toJSON length size callback handler reason status "
            "Symbol.iterator Symbol.toPrimitive Symbol.toStringTag value"
        ),
    ),
    "array_prototype_accessors": ("Array.prototype", words("0 1 2 3")),
    "promise": (
        "Promise.prototype",
        words("then catch finally constructor Symbol.toStringTag"),
    ),
    "promise_statics": (
        "Promise",
        words("resolve reject all allSettled race any withResolvers Symbol.species"),
    ),
    "map_set": ("Map.prototype", words("get set has delete clear forEach entries keys values")),
    "set_weakmap": ("Set.prototype", words("add has delete forEach values")),
    "weakmap": ("WeakMap.prototype", words("get set has delete")),
    "function_prototype": ("Function.prototype", words("call apply bind toString")),
    "reflect": (
        "Reflect",
        words(
            "apply construct get set has ownKeys defineProperty getOwnPropertyDescriptor "
            "getPrototypeOf deleteProperty"
        ),
    ),
    "regexp": (
        "RegExp.prototype",
        words("exec test toString Symbol.replace Symbol.split Symbol.match flags source global"),
    ),
    "globals": (
        "globalThis",
        words(
            "String Number Boolean Symbol parseInt parseFloat isNaN isFinite encodeURIComponent "
            "decodeURIComponent"
        ),
    ),
    "math_number": ("Math", words("trunc floor ceil max min abs round")),
    "number_statics": ("Number", words("isFinite isInteger isNaN isSafeInteger parseInt")),
    "error": ("Error", words("captureStackTrace")),
    "error_prototype": ("Error.prototype", words("toString name message")),
    "typed_arrays": ("Uint8Array.prototype", words("set subarray slice")),
    "text_codecs": ("ArrayBuffer.prototype", words("slice")),
    "symbol": ("Symbol", words("for keyFor")),
    # The runtime's own globals, read back by whatever looks them up after the cell changed them.
    "installed_globals": ("globalThis", [*HELPERS, "tools", "ALL_TOOLS"]),
}


def _override_source(target: str, keys: list[str]) -> str:
    return "".join(
        f"__override({target}, {key if key.startswith('Symbol.') else js(key)});\n" for key in keys
    )


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize("group", sorted(OVERRIDES))
async def test_overridden_builtins(
    harness: Harness, canary: Canary, group: str, store: str
) -> None:
    target, keys = OVERRIDES[group]
    body = (
        _override_source(target, keys)
        + "try { await __exercise(); } catch (e) { __harvest(e); }\n"
        + "__restore();\n"
    )
    await probe(harness, canary, body, store=store)


async def test_installed_globals_replaced_by_proxies(harness: Harness, canary: Canary) -> None:
    # The cell swaps every installed global for a spying Proxy of itself, then uses them all.
    body = (
        "const originals = {};\n"
        f"for (const name of [...{js(HELPERS)}, 'tools', 'ALL_TOOLS']) {{\n"
        "  const value = globalThis[name];\n"
        "  if (value === undefined) continue;\n"
        "  originals[name] = value;\n"
        "  globalThis[name] = new Proxy(value, __spyHandler());\n"
        "}\n"
        "tools.echo = new Proxy(originals.tools.echo, __spyHandler());\n"
        "try { await __exercise(); } catch (e) { __harvest(e); }\n"
        "try { await import('fs'); } catch (e) { __harvest(e); }\n"
        "await new Promise((resolve) => setTimeout(resolve, 5));\n"
        "for (const name of Object.keys(originals)) globalThis[name] = originals[name];\n"
    )
    await probe(harness, canary, body)


@pytest.mark.parametrize(
    "thrown",
    [
        "__hostile('thrown')",
        "new Proxy({}, __spyHandler())",
        "new Proxy(new Error('e'), __spyHandler())",
        "Object.defineProperty(new Error('e'), 'stack', {configurable: true, get: __fn("
        "'__harvest(this); __harvest(arguments.callee.caller); return \"stack\"')})",
    ],
    ids=["coercion_hooks", "proxy", "proxy_error", "stack_getter"],
)
@pytest.mark.parametrize("how", ["throw", "reject", "timer"])
async def test_hostile_thrown_values(
    harness: Harness, canary: Canary, thrown: str, how: str
) -> None:
    # The engine turns the uncaught value into error_text after the cell's code stopped: each hook
    # it calls probes at once.
    body = (
        "let probing = false;\n"
        "const probeNow = () => { if (probing) return; probing = true; "
        "try { __probeAll('thrown'); } catch (e) {} finally { probing = false; } };\n"
        f"const value = {thrown};\n"
        "const hooked = new Proxy(value, {get(t, k, r) { __harvest(t); __harvest(r); probeNow(); "
        "return Reflect.get(t, k, t); }});\n"
    )
    if how == "throw":
        body += "throw hooked;\n"
    elif how == "reject":
        body += "await Promise.reject(hooked);\n"
    else:
        body += "setTimeout(() => { throw hooked; }, 0);\nawait new Promise(() => {});\n"
    delegate = RecordingDelegate()
    session = await harness.session(delegate)
    result = await finish(session, canary.cell(body, end=False))
    assert_no_escape(canary, result, delegate)
    assert_probes_sound(result, end=False)
    assert result.error_text is not None


# -- 6. import(), import.meta, eval, WebAssembly, SharedArrayBuffer, Atomics --------------------------

_WASM = "new Uint8Array([0,97,115,109,1,0,0,0,1,5,1,96,0,1,127,3,2,1,0,7,5,1,1,102,0,0,10,6,1,4,0,65,42,11])"

LANGUAGE_CASES: dict[str, str] = {
    "dynamic_import": (
        "const specs = ['fs', 'node:fs', 'node:child_process', 'child_process', 'process', "
        "'data:text/javascript,export default globalThis', './x.mjs', '../x.mjs', 'exec_main.mjs', "
        "'file:///etc/passwd', '/etc/passwd', '', 'https://example.com/x.mjs', "
        "__hostile('fs'), new Proxy({}, __spyHandler())];\n"
        "for (const spec of specs) {\n"
        "  let pr;\n"
        "  try { pr = import(spec); } catch (e) { __harvest(e); continue; }\n"
        "  __harvest(pr);\n"
        "  __probe('import promise', () => pr.constructor.constructor);\n"
        "  try { const m = await pr; __harvest(m); for (const k of Reflect.ownKeys(m)) "
        "__harvest(m[k]); __probe('imported ' + String(spec), () => m.default.constructor.constructor); }\n"
        "  catch (e) { __harvest(e); __probe('import reason', () => e.constructor.constructor); }\n"
        "}\n"
        "for (const spec of ['fs', 'data:application/json,{}']) {\n"
        "  try { __harvest(await import(spec, {with: {type: 'json'}})); } catch (e) { __harvest(e); }\n"
        "}\n"
    ),
    "eval": (
        payload("eval('this').constructor.constructor")
        + payload("eval.constructor.constructor")
        + payload("eval.call.constructor")
        + payload("(0, eval)('this').constructor.constructor")
        + payload("(0, eval)('(function () { return this })()').constructor.constructor")
        + payload("(0, eval)('Function')")
        + payload("eval('(function () { return this })').call(undefined).constructor.constructor")
        + payload("Function('return eval')()('this').constructor.constructor")
        + payload("new Function('return Function')()")
        + payload("(async () => {}).constructor")
        + payload("(function* () {}).constructor")
        + payload("(async function* () {}).constructor")
        + "try { const r = (0, eval)('%GetOptimizationStatus(Function)'); "
        "__say('natives syntax', 'ALLOWED ' + String(r)); } catch (e) { __harvest(e); }\n"
        "try { const r = eval('%DebugPrint(1)'); __say('natives syntax', 'ALLOWED ' + String(r)); } "
        "catch (e) { __harvest(e); }\n"
        "for (const name of ['gc', 'd8', 'version', 'print', 'quit', 'load', 'read', 'readbuffer', "
        "'os', 'Realm', 'testRunner', 'performance', '$262', 'global', 'self', 'window']) {\n"
        "  const v = Object.getOwnPropertyDescriptor(globalThis, name);\n"
        "  if (v !== undefined && !['load'].includes(name)) __say(name, 'ALLOWED: a non-standard global');\n"
        "}\n"
    ),
    "webassembly": (
        "if (typeof WebAssembly !== 'undefined') {\n"
        + forms("WebAssembly")
        + f"  const mod = new WebAssembly.Module({_WASM});\n"
        "  const inst = new WebAssembly.Instance(mod, {});\n"
        + forms("mod")
        + forms("inst")
        + forms("inst.exports")
        + forms("inst.exports.f")
        + "  __harvest(await WebAssembly.instantiate("
        + _WASM
        + "));\n"
        "  try { const mem = new WebAssembly.Memory({initial: 1, maximum: 1, shared: true}); "
        "__harvest(mem.buffer); __probe('wasm SAB', () => mem.buffer.constructor.constructor); } "
        "catch (e) { __harvest(e); }\n"
        "  for (const k of ['Table', 'Global', 'Memory', 'Tag', 'Exception']) "
        "if (WebAssembly[k]) __harvest(WebAssembly[k]);\n"
        "} else { __text('no WebAssembly'); }\n"
    ),
    "shared_memory_atomics": (
        "if (typeof SharedArrayBuffer !== 'undefined') {\n"
        "  const sab = new SharedArrayBuffer(16);\n" + forms("sab") + "}\n"
        "if (typeof Atomics !== 'undefined') {\n"
        + forms("Atomics")
        + "  try { __harvest(Atomics.wait(new Int32Array(4), 0, 0, 0)); } catch (e) { __harvest(e); }\n"
        "  try { const r = Atomics.waitAsync && Atomics.waitAsync(new Int32Array(new "
        "SharedArrayBuffer(16)), 0, 0, 1); __harvest(r); __harvest(r && r.value); } catch (e) "
        "{ __harvest(e); }\n"
        "}\n"
    ),
    "shadow_realm": (
        "if (typeof ShadowRealm !== 'undefined') {\n"
        "  const realm = new ShadowRealm();\n"
        '  const seen = realm.evaluate(\'typeof process + ":" + typeof '
        'globalThis.constructor.constructor("return this")().process\');\n'
        "  __say('ShadowRealm', 'process=' + (seen === 'undefined:undefined' ? 'undefined' : seen));\n"
        "} else { __text('no ShadowRealm'); }\n"
    ),
    "other_builtins": (
        "".join(
            forms(x)
            for x in (
                "new Intl.DateTimeFormat()",
                "new FinalizationRegistry(() => {})",
                "new WeakRef({})",
                "Iterator.from([1])",
                "new Date(0)",
                "/x/",
                "Symbol('s')",
                "10n",
                "new Proxy({}, {})",
                "new (class {})()",
                "new ArrayBuffer(8)",
                "new DataView(new ArrayBuffer(8))",
            )
        )
        + "if (typeof DisposableStack !== 'undefined') { const s = new DisposableStack(); "
        "s.defer(__mkSpy(() => {})); s.dispose(); }\n"
    ),
}


@pytest.mark.parametrize("case", sorted(LANGUAGE_CASES))
async def test_language_features(harness: Harness, canary: Canary, case: str) -> None:
    # An engine without the feature (WebAssembly, ShadowRealm, ...) has nothing to probe.
    await probe(harness, canary, LANGUAGE_CASES[case], minimum=0)


async def test_import_meta(harness: Harness, canary: Canary) -> None:
    # import.meta only parses in module code: an engine that refuses it at compile time runs
    # nothing (a SyntaxError is safe); one that accepts it must expose nothing of the host.
    body = (
        "const meta = import.meta;\n"
        + forms("meta")
        + "for (const k of Reflect.ownKeys(meta)) { __harvest(meta[k]); "
        "__probe('import.meta.' + String(k), () => meta[k].constructor.constructor); }\n"
        "if (typeof meta.resolve === 'function') { try { __harvest(meta.resolve('fs')); } "
        "catch (e) { __harvest(e); } }\n"
        "__probeAll('harvest');\n"
    )
    delegate = RecordingDelegate()
    session = await harness.session(delegate)
    result = await finish(session, canary.cell(body))
    assert_no_escape(canary, result, delegate)
    if result.error_text is not None and result.error_text.startswith("SyntaxError"):
        assert probe_lines(result) == []
    else:
        assert_probes_sound(result, minimum=1)


@pytest.mark.parametrize(
    "source",
    [
        'import fs from "fs";',
        'import * as cp from "node:child_process";',
        'import "data:text/javascript,globalThis.x = 1";',
        'import x from "./exec_main.mjs";',
        'export { default } from "fs";',
        'import process from "process";',
        'import json from "data:application/json,{}" with { type: "json" };',
    ],
)
async def test_static_imports_are_refused(harness: Harness, canary: Canary, source: str) -> None:
    delegate = RecordingDelegate()
    session = await harness.session(delegate)
    result = await finish(session, canary.cell(source + "\n" + payload("process"), end=True))
    assert_no_escape(canary, result, delegate)
    assert result.error_text is not None, texts(result)
    assert probe_lines(result) == []


# -- 7. timer callbacks --------------------------------------------------------------------------

_SLOPPY_CALLBACK = (
    "__fn('__harvest(this); for (var i = 0; i < arguments.length; i++) __harvest(arguments[i]); "
    "__harvest(arguments); var c = arguments.callee; for (var d = 0; d < 16 && c; d++) "
    "{ try { c = c.caller; } catch (e) { __harvest(e); break; } __harvest(c); } "
    "__harvest(new Error().stack);')"
)

TIMER_CASES: dict[str, str] = {
    "sloppy_callback": f"setTimeout({_SLOPPY_CALLBACK}, 0);",
    "sloppy_callback_extra_args": f"setTimeout({_SLOPPY_CALLBACK}, 0, {{a: 1}}, 'x', [2]);",
    "spy_callback": "setTimeout(__mkSpy(() => {}), 0, {a: 1});",
    "bound_callback": f"setTimeout({_SLOPPY_CALLBACK}.bind(undefined), 1);",
    "proxy_callback": "setTimeout(new Proxy(function () {}, __spyHandler()), 0, 1, 2);",
    "async_sloppy_callback": (
        "setTimeout((async () => {}).constructor('__harvest(this); __harvest(arguments); "
        "try { __harvest(arguments.callee.caller); } catch (e) { __harvest(e); }'), 0);"
    ),
    "generator_callback": "setTimeout(function* () { __harvest(this); }, 0);",
    "nested_timers": (
        f"setTimeout(() => {{ setTimeout({_SLOPPY_CALLBACK}, 0); "
        f"clearTimeout(setTimeout({_SLOPPY_CALLBACK}, 0)); }}, 0);"
    ),
    "delay_coercion": (
        "const id = setTimeout(() => {}, {valueOf: __mkSpy(() => 1), toString: __mkSpy(() => '1')}); "
        "clearTimeout({valueOf: __mkSpy(() => id), [Symbol.toPrimitive]: __mkSpy(() => id)});"
    ),
    "callback_with_own_properties": (
        f"const cb = {_SLOPPY_CALLBACK}; cb.call = __mkSpy(Function.prototype.call); "
        "cb.apply = __mkSpy(Function.prototype.apply); cb.bind = __mkSpy(Function.prototype.bind); "
        "Object.setPrototypeOf(cb, new Proxy(Function.prototype, __spyHandler())); setTimeout(cb, 0);"
    ),
}


@pytest.mark.parametrize("case", sorted(TIMER_CASES))
async def test_timer_callbacks(harness: Harness, canary: Canary, case: str) -> None:
    body = (
        TIMER_CASES[case]
        + "\nawait new Promise((resolve) => setTimeout(resolve, 30));\n"
        + "const timerId = setTimeout(() => {}, 1e6);\n"
        + forms("timerId")
    )
    await probe(harness, canary, body)
