"""The sandbox attack corpus: fixtures and the JavaScript probe kit shared by its tests.

Cells are hostile (prompt injection writes them). Every test here runs a cell that tries to leave the
JavaScript sandbox and checks, from the outside, that it did not:

* ``canary``: a directory holding ``secret.txt`` (a random token) and the paths of two marker files
  that an escaped cell would create — one written through Node's ``fs``, one by spawning
  ``/bin/sh -c 'touch MARKER'`` (``child_process.execSync``);
* ``assert_no_escape(canary, *outputs)``: no marker exists and the token appears in no output text,
  no error text, no tool-call argument and no notification;
* ``payload(F)``: a JavaScript statement that takes an expression ``F`` which might evaluate to a
  Node-realm ``Function`` constructor, tries ``F('return process')()`` and, if that yields a process
  object, writes the markers and prints the secret; it reports what it found as a ``probe`` line;
* the *kit* (``Canary.cell``) prepended to every probing cell: ``__probe``, ``__harvest`` (collect
  any object a hostile hook got hold of), ``__probeAll`` (run the payload on the constructors of
  everything harvested and flag objects of another realm), ``__mkSpy`` (a sloppy function that
  records its receiver, arguments and caller chain), ``__override`` / ``__restore`` (swap built-ins
  for spies) and ``__exercise`` (call every helper and tool, including their error paths).

``assert_probes_sound`` reads the probe lines: a sound engine only ever shows ``process=undefined``
or ``blocked: ...`` and never ``realm=foreign`` (an object from another JavaScript realm reachable
from the cell is an escape even when that realm has no ``process``).
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from codemode.protocol import (
    CellId,
    ContentItem,
    ExecuteRequest,
    InputAudio,
    InputImage,
    InputText,
    Result,
    RuntimeResponse,
    Terminated,
    ToolDefinition,
    WaitRequest,
    Yielded,
)
from codemode.session import (
    CodeModeSession,
)
from tests.contract.conftest import EmbeddedHarness, Harness, StdioHarness
from tests.contract.delegate import FIXTURE_TOOLS

__all__ = [
    "END",
    "Canary",
    "Harness",
    "P",
    "assert_no_escape",
    "assert_probes_sound",
    "finish",
    "payload",
    "probe_lines",
    "strings_of",
    "texts",
]

#: A valid image data URL.
P = "data:image/png;base64,AAA"
#: The text item a probing cell prints once it ran to its end.
END = "sandbox-probe-end"

SANDBOX_IMPLEMENTATIONS: dict[str, type[Harness]] = {
    "embedded": EmbeddedHarness,
    "stdio": StdioHarness,
}


@pytest.fixture(params=sorted(SANDBOX_IMPLEMENTATIONS))
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    """One harness per session implementation (embedded and ``codemode host --stdio``)."""
    instance: Harness = SANDBOX_IMPLEMENTATIONS[request.param]()
    try:
        yield instance
    finally:
        await asyncio.wait_for(instance.aclose(), 30)


# -- the canary ------------------------------------------------------------------------------------

_KIT = r"""
// ---- sandbox probe kit (tests/sandbox/conftest.py) --------------------------------------------
const __MARK1 = %(mark_fs)s, __MARK2 = %(mark_sh)s, __SECRET = %(secret)s;
const __text = text;
const __ObjectProto = Object.prototype;
const __getProto = Object.getPrototypeOf;
const __hasOwn = Object.hasOwn;
const __ownKeys = Reflect.ownKeys;
const __getDesc = Reflect.getOwnPropertyDescriptor;
const __defineProp = Reflect.defineProperty;
const __deleteProp = Reflect.deleteProperty;
const __apply = Reflect.apply;
const __String = String;
const __P = 'data:image/png;base64,AAA';
const __BODY = 'return typeof process !== "undefined" ? process : (this && this.process)';

function __str(v) { try { return __String(v); } catch (e) { return '<' + typeof v + '>'; } }
function __say(label, what) { try { __text('probe ' + label + ': ' + what); } catch (e) {} }
function __isObj(v) { return v !== null && (typeof v === 'object' || typeof v === 'function'); }

// 'own': the prototype chain reaches this cell's Object.prototype; 'bare': a null-prototype object;
// 'foreign': the chain ends somewhere else, i.e. at another realm's Object.prototype.
function __realm(v) {
  if (!__isObj(v)) return 'primitive';
  let o = v;
  for (let i = 0; i < 100000; i++) {
    if (o === __ObjectProto) return 'own';
    let next;
    try { next = __getProto(o); } catch (e) { return 'opaque'; }
    if (next === null) return o === v ? 'bare' : 'foreign';
    o = next;
  }
  return 'opaque';
}

// The escape itself: what an attacker does with a Node `process`.
function __attempt(label, realm, p) {
  if (p) {
    try {
      const mod = (name) => (p.getBuiltinModule ? p.getBuiltinModule(name) : p.mainModule.require(name));
      const fs = mod('fs');
      fs.writeFileSync(__MARK1, 'x');
      __text(fs.readFileSync(__SECRET, 'utf8'));
      mod('child_process').execSync('touch "' + __MARK2 + '"');
    } catch (e) {
      __say(label, 'ESCAPED (process reached) but the payload failed: ' + __str(e));
    }
  }
  __say(label, 'realm=' + realm + ' process=' + typeof p);
}

let __waiting = null;
// payload(F): F() might be a Node-realm Function constructor.
function __probe(label, get) {
  let f;
  try { f = get(); } catch (e) { __say(label, 'blocked: ' + __str(e)); return; }
  const realm = __realm(f);
  if (typeof f !== 'function') { __say(label, 'realm=' + realm + ' F=' + typeof f); return; }
  let r;
  try { r = f(__BODY)(); } catch (e) { __say(label, 'realm=' + realm + ' blocked: ' + __str(e)); return; }
  try {
    if (__isObj(r) && typeof r.next === 'function' && typeof r.return === 'function') {
      const step = r.next(); // a (async) generator function constructor
      r = __isObj(step) && typeof step.then === 'function' ? step.then((x) => x.value) : step.value;
    }
    if (__isObj(r) && typeof r.then === 'function') { // an async function constructor
      const settled = r.then((v) => __attempt(label, realm, v),
                             (e) => __say(label, 'realm=' + realm + ' blocked: ' + __str(e)));
      __waiting = {p: settled, next: __waiting};
      return;
    }
  } catch (e) {
    __say(label, 'realm=' + realm + ' blocked: ' + __str(e));
    return;
  }
  __attempt(label, realm, r);
}

async function __settle() {
  for (let round = 0; round < 8 && __waiting !== null; round++) {
    let w = __waiting;
    __waiting = null;
    for (; w !== null; w = w.next) { try { await w.p; } catch (e) {} }
  }
}

// -- harvesting: every object a hostile hook sees is kept (at most 3 per constructor) ---------------
let __found = null;
let __count = 0;
let __kinds = null;
let __busy = false;
// The global object itself is left to the global-object cases (a sloppy function called without
// a receiver sees it as `this`), so that the other families show their own leaks.
function __harvest(v) {
  if (!__isObj(v) || v === globalThis || __busy || __count >= 600) return;
  __busy = true;
  try {
    for (let n = __found; n !== null; n = n.next) if (n.v === v) return;
    let c;
    try { c = v.constructor; } catch (e) { c = e; }
    let k = __kinds;
    while (k !== null && k.c !== c) k = k.next;
    if (k === null) k = __kinds = {c, n: 0, next: __kinds};
    if (k.n >= 3) return;
    k.n += 1;
    __found = {v, next: __found};
    __count += 1;
  } finally {
    __busy = false;
  }
}
__defineProp(globalThis, '__harvest', {value: __harvest, writable: true, configurable: true});
// Harvest a value; if it is a promise, also its rejection reason (and never leave it unhandled).
function __keep(v) {
  __harvest(v);
  try { if (__isObj(v) && typeof v.then === 'function') v.then(__harvest, __harvest); } catch (e) { __harvest(e); }
  return v;
}

function __describe(v) {
  let name = '';
  try { if (typeof v === 'function') name = ' ' + __str(v.name); } catch (e) {}
  return typeof v + name;
}

let __probing = false;
function __probeAll(tag) {
  if (__probing) return;
  __probing = true;
  try { __probeAllNow(tag); } finally { __probing = false; }
}
function __probeAllNow(tag) {
  let i = 0;
  for (let round = 0; round < 3 && __found !== null; round++) {
    let n = __found;
    __found = null;
    __count = 0;
    __kinds = null;
    for (; n !== null; n = n.next) {
      const v = n.v;
      const label = tag + '#' + i++ + '(' + __describe(v) + ')';
      if (__realm(v) === 'foreign') __say(label, 'realm=foreign value');
      __probe(label + '.constructor.constructor', () => v.constructor.constructor);
      __probe(label + '.[[Prototype]].constructor.constructor', () => __getProto(v).constructor.constructor);
      if (typeof v === 'function') __probe(label + '.constructor', () => v.constructor);
      let keys = [];
      try { keys = __ownKeys(v); } catch (e) {}
      for (let j = 0; j < keys.length && j < 64; j++) {
        let d;
        try { d = __getDesc(v, keys[j]); } catch (e) { continue; }
        if (d === undefined) continue;
        const parts = [d.value, d.get, d.set];
        for (let k = 0; k < 3; k++) {
          if (__realm(parts[k]) === 'foreign') __say(label + '.' + __str(keys[j]), 'realm=foreign property');
        }
      }
    }
  }
}

// Function(...) when code generation from strings is allowed, else a stand-in (reported).
function __fn(...args) {
  try { return Function(...args); } catch (e) {
    __say('codegen', 'blocked: ' + __str(e));
    return function () {};
  }
}

// __mkSpy(impl): a sloppy function that records `this`, its arguments and the chain of callers
// (a host function calling it would show up there), then behaves like impl.
const __mkSpy = (() => {
  try {
    return Function('h', 'ap', `
      return function (impl) {
        return function () {
          h(this);
          for (var i = 0; i < arguments.length; i++) h(arguments[i]);
          var c = arguments.callee;
          for (var d = 0; d < 16 && c; d++) {
            try { c = c.caller; } catch (e) { h(e); break; }
            h(c);
          }
          return ap(impl, this, arguments);
        };
      };`)(__harvest, __apply);
  } catch (e) {
    __say('codegen', 'blocked: ' + __str(e));
    return (impl) => function (...args) {
      __harvest(this);
      for (let i = 0; i < args.length; i++) __harvest(args[i]);
      return __apply(impl, this, args);
    };
  }
})();

// A handler whose every trap is a spy doing the default (Reflect) behaviour.
function __spyHandler() {
  const traps = {};
  const names = __ownKeys(Reflect);
  for (let i = 0; i < names.length; i++) {
    const name = names[i];
    if (typeof Reflect[name] === 'function') traps[name] = __mkSpy(Reflect[name]);
  }
  return traps;
}

// An object whose coercion hooks and interesting getters are all spies.
function __hostile(value) {
  const o = {};
  const give = () => value;
  o.toJSON = __mkSpy(give);
  o.toString = __mkSpy(give);
  o.valueOf = __mkSpy(give);
  o[Symbol.toPrimitive] = __mkSpy(give);
  const keys = ['image_url', 'detail', 'type', 'data', 'mimeType', 'mime_type', '_meta', 'audio_url',
                'output_hint', 'then', 'stack', 'message', 'name', 'length', 'cause'];
  for (let i = 0; i < keys.length; i++) {
    const key = keys[i];
    const answer = key === 'detail' ? 'high' : key === 'type' ? 'image' : key === 'then' || key === 'length' || key === '_meta' ? undefined : value;
    __defineProp(o, key, {get: __mkSpy(() => answer), enumerable: true, configurable: true});
  }
  return o;
}

// -- overriding built-ins -------------------------------------------------------------------------
let __saved = null;
function __override(obj, key) {
  let old;
  try { old = __getDesc(obj, key); } catch (e) { return; }
  __saved = {obj, key, old, next: __saved};
  if (old === undefined) {
    // absent: an accessor that reads as absent and turns writes into own data properties
    __defineProp(obj, key, {
      configurable: true,
      enumerable: false,
      get: __mkSpy(function () { return undefined; }),
      set: __mkSpy(function (v) {
        __defineProp(this, key, {value: v, writable: true, enumerable: true, configurable: true});
      }),
    });
  } else if (__hasOwn(old, 'value')) {
    if (typeof old.value === 'function') {
      __defineProp(obj, key, {value: __mkSpy(old.value), writable: old.writable,
                              enumerable: old.enumerable, configurable: old.configurable});
    } else {
      // any other value: an accessor that gives the same value (whoever reads it is recorded)
      const value = old.value;
      __defineProp(obj, key, {
        configurable: old.configurable,
        enumerable: old.enumerable,
        get: __mkSpy(function () { return value; }),
        set: __mkSpy(function (v) {
          __defineProp(this, key, {value: v, writable: true, enumerable: true, configurable: true});
        }),
      });
    }
  } else {
    __defineProp(obj, key, {get: old.get === undefined ? undefined : __mkSpy(old.get),
                            set: old.set === undefined ? undefined : __mkSpy(old.set),
                            enumerable: old.enumerable, configurable: old.configurable});
  }
}
function __restore() {
  while (__saved !== null) {
    const s = __saved;
    __saved = s.next;
    if (s.old === undefined) __deleteProp(s.obj, s.key);
    else __defineProp(s.obj, s.key, s.old);
  }
}

// Call every helper and tool, the error paths included; keep whatever comes back or is thrown.
async function __exercise() {
  const cyclic = {};
  cyclic.self = cyclic;
  const keep = (v) => { __harvest(v); return v; };
  const steps = [
    () => text('exercise'), () => text({a: [1, 'b'], n: null}), () => text(10n),
    () => image(__P), () => image({image_url: __P, detail: 'low'}), () => image(__P, 'HIGH'),
    () => image({type: 'image', data: 'AAA', mimeType: 'image/png', _meta: {'codex/imageDetail': 'original'}}),
    () => generatedImage({image_url: __P, output_hint: 'hint'}),
    () => audio('data:audio/mpeg;base64,AAAA'), () => audio({audio_url: 'data:audio/mpeg;base64,AAAA'}),
    () => notify('exercise'), () => notify({a: 1}),
    () => store('exercise', {a: [1, {b: 2}], s: 'x'}), () => load('exercise'), () => load('missing'),
    () => store(7, 'seven'), () => load(7), () => load('pad'),
    () => clearTimeout(setTimeout(() => {}, 1e6)),
    () => image(5), () => image('https://example.com/a.png'), () => image(__P, 'medium'),
    () => audio(5), () => generatedImage(5),
    () => store('fn', () => 1), () => store('big', 10n), () => store('cyc', cyclic), () => store('u'),
    () => notify(''), () => text(cyclic), () => clearTimeout(Symbol()), () => setTimeout('x'),
    () => tools.echo(cyclic), () => tools.nope(),
  ];
  for (let i = 0; i < steps.length; i++) {
    try { keep(steps[i]()); } catch (e) { keep(e); }
  }
  const calls = [
    () => tools.echo({a: [1, {b: 2}], s: 'x'}), () => tools.echo(), () => tools.patch('*** Begin'),
    () => tools.fail({}), () => tools.echo('not an object'), () => tools.patch({a: 1}),
    () => tools.hidden_dynamic_tool({}),
  ];
  for (let i = 0; i < calls.length; i++) {
    try { keep(await keep(calls[i]())); } catch (e) { keep(e); }
  }
  try { keep(await Promise.all([tools.echo({i: 1}), tools.echo({i: 2})])); } catch (e) { keep(e); }
  try { await new Promise((resolve) => keep(setTimeout(resolve, 1))); } catch (e) { keep(e); }
}
// ---- end of the probe kit -------------------------------------------------------------------------
"""


@dataclass(frozen=True)
class Canary:
    """A secret an escaped cell could read and the markers it would leave behind."""

    directory: Path
    token: str
    secret: Path
    mark_fs: Path
    mark_sh: Path

    def kit(self) -> str:
        """The probe kit (JavaScript), aimed at this canary."""
        return _KIT % {
            "mark_fs": json.dumps(str(self.mark_fs)),
            "mark_sh": json.dumps(str(self.mark_sh)),
            "secret": json.dumps(str(self.secret)),
        }

    def cell(self, body: str, *, end: bool = True) -> str:
        """A probing cell: the kit, ``body``, then (``end``) settle the probes and print ``END``."""
        tail = f"\nawait __settle();\n__text({json.dumps(END)});\n" if end else "\n"
        return self.kit() + "\n" + body + tail


@pytest.fixture
def canary(tmp_path: Path) -> Canary:
    directory = tmp_path / "canary"
    directory.mkdir()
    token = "CANARY-" + secrets.token_hex(16)
    secret = directory / "secret.txt"
    secret.write_text(token)
    return Canary(
        directory=directory,
        token=token,
        secret=secret,
        mark_fs=directory / "escaped-by-fs",
        mark_sh=directory / "escaped-by-sh",
    )


def payload(F: str, label: str | None = None) -> str:
    """A statement: try ``F('return process')()`` and, on success, leave the markers (see module doc).

    ``F`` is evaluated lazily inside a try block (a throw reports ``blocked: ...``); the probe line
    says the realm of what ``F`` gave and ``typeof`` the process it found.
    """
    return f"__probe({json.dumps(label or F)}, () => ({F}));\n"


# -- outcomes ----------------------------------------------------------------------------------------


def strings_of(value: object) -> list[str]:
    """Every string a value carries to the outside (items, errors, tool inputs, notifications)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, InputText):
        return [value.text]
    if isinstance(value, InputImage):
        return [value.image_url]
    if isinstance(value, InputAudio):
        return [value.audio_url]
    if isinstance(value, Result):
        return [*strings_of(value.content_items), *([value.error_text] if value.error_text else [])]
    if isinstance(value, (Yielded, Terminated)):
        return strings_of(value.content_items)
    if isinstance(value, dict):
        return [s for key, item in value.items() for s in (*strings_of(key), *strings_of(item))]
    if isinstance(value, (list, tuple, set, frozenset)):
        return [s for item in value for s in strings_of(item)]
    if isinstance(value, (int, float, bool)) or value is None:
        return []
    return [repr(value)]  # a delegate, a tool call, ...: its repr names every field


def assert_no_escape(canary: Canary, *outputs: object) -> None:
    """No marker file exists and the secret token is in none of ``outputs``."""
    how = [
        line
        for output in outputs
        if isinstance(output, (Result, Yielded, Terminated))
        for line in _bad_lines(probe_lines(output))
    ][:10]
    for marker in (canary.mark_fs, canary.mark_sh):
        assert not marker.exists(), f"the cell escaped the sandbox: it created {marker}; {how}"
    leftovers = sorted(p.name for p in canary.directory.iterdir() if p != canary.secret)
    assert leftovers == [], f"the cell escaped the sandbox: it created {leftovers}; {how}"
    for output in outputs:
        for text in strings_of(output):
            assert canary.token not in text, "the cell escaped the sandbox: it read the secret"


async def start(
    session: CodeModeSession, source: str, yield_ms: int = 10_000
) -> tuple[CellId, RuntimeResponse]:
    """Execute ``source`` with the fixture tools: its cell id and its initial response."""
    started = await session.execute(
        ExecuteRequest(
            tool_call_id="call",
            source=source,
            enabled_tools=list(FIXTURE_TOOLS),
            yield_time_ms=yield_ms,
        )
    )
    return started.cell_id, await started.initial_response()


def texts(response: RuntimeResponse) -> list[str]:
    return [item.text for item in response.content_items if isinstance(item, InputText)]


def probe_lines(response: RuntimeResponse) -> list[str]:
    return [text for text in texts(response) if text.startswith("probe ")]


BAD_WORDS = ("realm=foreign", "ESCAPED", "ALLOWED")


def _bad_lines(lines: list[str]) -> list[str]:
    return [
        line
        for line in lines
        if any(word in line for word in BAD_WORDS)
        or ("process=" in line and "process=undefined" not in line)
    ]


def assert_probes_sound(response: RuntimeResponse, *, end: bool = True, minimum: int = 0) -> None:
    """Every probe line shows a sound sandbox; with ``end`` the cell ran to its last line."""
    lines = probe_lines(response)
    bad = _bad_lines(lines)
    assert bad == [], "\n".join(bad[:40])
    if end:
        error = response.error_text if isinstance(response, Result) else None
        assert END in texts(response), f"the probing cell did not run to its end: {error!r}"
    assert len(lines) >= minimum, f"only {len(lines)} probe lines: {texts(response)[:20]}"


async def finish(
    session: CodeModeSession,
    source: str,
    *,
    tools: list[ToolDefinition] | None = None,
    timeout: float = 30.0,
    call_id: str = "call-1",
) -> Result:
    """Run a cell to its completion (waiting through yields) within ``timeout`` seconds.

    Returns the ``Result`` whose items are everything the cell produced across observations.
    """

    async def go() -> Result:
        started = await session.execute(
            ExecuteRequest(
                tool_call_id=call_id,
                source=source,
                enabled_tools=list(FIXTURE_TOOLS if tools is None else tools),
                yield_time_ms=10_000,
            )
        )
        collected: list[ContentItem] = []
        response = await started.initial_response()
        while isinstance(response, Yielded):
            collected += response.content_items
            outcome = await session.wait(WaitRequest(CellId(str(started.cell_id)), 10_000))
            response = outcome.response
        assert isinstance(response, Result), response
        return Result(response.cell_id, collected + response.content_items, response.error_text)

    return await asyncio.wait_for(go(), timeout)


def js(value: Any) -> str:
    """A JavaScript literal of a JSON-able value."""
    return json.dumps(value)
