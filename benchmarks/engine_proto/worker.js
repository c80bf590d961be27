'use strict';
// Per-cell worker bootstrap (prototype). See host.js for the protocol.
//
// Lifecycle: the host spawns this file as a worker_threads Worker ahead of time
// (warm pool). At start-up it builds a fresh vm context (no Node globals), installs
// the code-mode globals inside it and posts {t:'warm'}. It then waits for exactly one
// {t:'exec'} message, evaluates the source as the ES module `exec_main.mjs`, reports
// the outcome and is discarded by the host (one isolate per cell).
//
// Only primitives cross the realm boundary between this file and the cell's context:
// the in-context bootstrap captures `hostSend` in a closure and receives results as a
// JSON string, so no outer-realm object (and so no `Function` constructor that could
// reach `process`) is ever exposed to cell code.

const { parentPort } = require('node:worker_threads');
const vm = require('node:vm');

// ---- outbound batching: every message queued in one turn is one postMessage --------
let outbox = [];
let flushQueued = false;
function flush() {
  flushQueued = false;
  if (outbox.length === 0) return;
  const batch = outbox;
  outbox = [];
  parentPort.postMessage(batch);
}
// Tool calls wait for the end of the turn (so Promise.all of N calls is one message);
// anything that must survive a later runaway loop or terminate (output, 'started',
// 'done') is flushed at once, after whatever is queued, so order is preserved.
function post(msg, urgent = false) {
  outbox.push(msg);
  if (urgent) {
    flush();
  } else if (!flushQueued) {
    flushQueued = true;
    queueMicrotask(flush);
  }
}

// ---- the cell context ---------------------------------------------------------------
const context = vm.createContext(Object.create(null), {
  name: 'exec',
  codeGeneration: { strings: true, wasm: false },
});

// Runs inside the context; returns the function the host uses to deliver results.
const IN_CONTEXT_BOOTSTRAP = `(function (hostSend, toolNames) {
  'use strict';
  const g = globalThis;
  for (const k of ['console', 'Atomics', 'SharedArrayBuffer', 'WebAssembly']) delete g[k];
  const stringify = JSON.stringify;
  const parse = JSON.parse;
  const pending = new Map();
  let nextCall = 1;
  const tools = Object.create(null);
  for (const name of toolNames) {
    tools[name] = function (arg) {
      const input = stringify(arg); // throws synchronously, before any promise exists
      const id = 'tool-' + nextCall++;
      return new Promise((resolve, reject) => {
        pending.set(id, [resolve, reject]);
        hostSend('call', id, name, input);
      });
    };
  }
  g.tools = Object.freeze(tools);
  g.text = function (v) { hostSend('text', typeof v === 'string' ? v : stringify(v)); };
  g.__errText = function (e) {
    if (typeof e === 'string') return e;
    if (e && typeof e.stack === 'string') return e.stack;
    try { return String(e); } catch { return 'uncaught exception'; }
  };
  // results: JSON text of [[callId, ok, valueOrError], ...]
  return function deliver(resultsJson) {
    for (const [id, ok, v] of parse(resultsJson)) {
      const p = pending.get(id);
      if (p === undefined) continue;
      pending.delete(id);
      if (ok) p[0](v); else p[1](String(v));
    }
  };
})`;

let deliver = null;
let cellId = null;
let errText = null;

function hostSend(kind, a, b, c) {
  if (kind === 'call') post({ t: 'call', cell: cellId, call: a, tool: b, input: c });
  else if (kind === 'text') post({ t: 'text', cell: cellId, text: a }, true);
}

async function runCell(msg) {
  cellId = msg.cell;
  deliver = vm.runInContext(IN_CONTEXT_BOOTSTRAP, context)(hostSend, msg.tools);
  errText = vm.runInContext('__errText', context);
  vm.runInContext('delete globalThis.__errText', context);
  let mod;
  try {
    mod = new vm.SourceTextModule(msg.src, {
      context,
      identifier: 'exec_main.mjs',
      importModuleDynamically: (spec) => {
        throw `Unsupported import in exec: ${spec}`;
      },
    });
    await mod.link((spec) => {
      throw `Unsupported import in exec: ${spec}`;
    });
  } catch (e) {
    post({ t: 'done', cell: cellId, error: errText(e) }, true);
    return;
  }
  post({ t: 'started', cell: cellId }, true);
  try {
    await mod.evaluate();
    post({ t: 'done', cell: cellId, error: null }, true);
  } catch (e) {
    post({ t: 'done', cell: cellId, error: errText(e) }, true);
  }
}

parentPort.on('message', (batch) => {
  // batch: array of {t:'exec', ...} or {t:'results', json}
  for (const msg of batch) {
    if (msg.t === 'results') {
      if (deliver !== null) deliver(msg.json);
    } else if (msg.t === 'exec') {
      runCell(msg);
    }
  }
});

post({ t: 'warm' });
