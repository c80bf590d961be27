'use strict';
// One cell's thread. host.js spawns this file as a worker_threads Worker ahead of time (a warm
// worker): it builds a fresh vm context, installs the prelude and reports {t:'warm'}. It then
// runs exactly one cell as the ES module `exec_main.mjs`, reports its outcome and exits; the
// isolate is never reused, so nothing leaks between cells.
//
// Messages to host.js are arrays (batches). Output, notifications, yields, 'started' and 'done'
// are flushed at once, in order, so they survive a cell that spins afterwards; tool calls wait for
// the end of the turn so that a Promise.all of many calls leaves as one message.

const { parentPort } = require('node:worker_threads');
const fs = require('node:fs');
const path = require('node:path');
const vm = require('node:vm');

// A rejected promise nobody awaits is ignored (runtime.md §2.5).
process.on('unhandledRejection', () => {});

let outbox = [];
let flushQueued = false;

function flush() {
  flushQueued = false;
  if (outbox.length === 0) return;
  const batch = outbox;
  outbox = [];
  parentPort.postMessage(batch);
}

function post(message, urgent) {
  outbox.push(message);
  if (urgent) flush();
  else if (!flushQueued) {
    flushQueued = true;
    queueMicrotask(flush);
  }
}

const PRELUDE_FILE = path.join(__dirname, 'prelude.js');
const context = vm.createContext({}, { name: 'exec', codeGeneration: { strings: true, wasm: false } });

let cell = null;
const realTimers = new Map();
let turn = 0; // counts returns of the cell's thread to its event loop (see yieldControl)
let turnEnding = false;

function stop() {
  flush();
  for (const handle of realTimers.values()) clearTimeout(handle);
  process.exit(0);
}

// WAV clip shorter than 25 ms? (runtime.md §5.5) Not measurable -> false (keep the audio).
function isShortWav(base64) {
  const bytes = Buffer.from(base64, 'base64');
  if (bytes.length < 12 || bytes.toString('latin1', 0, 4) !== 'RIFF' ||
      bytes.toString('latin1', 8, 12) !== 'WAVE') {
    return false;
  }
  let offset = 12;
  let rate = 0;
  let align = 0;
  let usable = -1;
  while (offset + 8 <= bytes.length) {
    const id = bytes.toString('latin1', offset, offset + 4);
    const size = bytes.readUInt32LE(offset + 4);
    const body = offset + 8;
    if (id === 'fmt ' && body + 14 <= bytes.length) {
      rate = bytes.readUInt32LE(body + 4);
      align = bytes.readUInt16LE(body + 12);
    } else if (id === 'data') {
      usable = Math.min(size, bytes.length - body);
    }
    offset = body + size + (size % 2);
  }
  if (usable < 0 || rate === 0 || align === 0) return false;
  // floor(usable / align) / rate < 0.025  <=>  frames * 40 < rate
  return Math.floor(usable / align) * 40 < rate;
}

const host = {
  item(type, value, detail) {
    post({ t: 'item', cell, type, value, detail }, true);
  },
  call(id, tool, input) {
    post({ t: 'call', cell, id, tool, input }, false);
  },
  notify(text) {
    post({ t: 'notify', cell, text }, true);
  },
  yieldControl() {
    // The turn lets the runtime see that two yields happened in one uninterrupted run of the
    // cell: an observer that attached in between (messages are in flight) was not there yet.
    if (!turnEnding) {
      turnEnding = true;
      setImmediate(() => {
        turn += 1;
        turnEnding = false;
      });
    }
    post({ t: 'yield', cell, turn }, true);
  },
  finish(error, writes) {
    post({ t: 'done', cell, error, writes }, true);
  },
  setTimer(id, ms) {
    realTimers.set(id, setTimeout(() => {
      realTimers.delete(id);
      api.fireTimer(id);
    }, ms));
  },
  clearTimer(id) {
    const handle = realTimers.get(id);
    if (handle !== undefined) {
      clearTimeout(handle);
      realTimers.delete(id);
    }
  },
  stop,
  isShortWav,
};

const api = vm.runInContext(fs.readFileSync(PRELUDE_FILE, 'utf8'), context, {
  filename: PRELUDE_FILE,
})(host);

function unsupportedImport(specifier) {
  throw `Unsupported import in exec: ${specifier}`;
}

async function runCell(message) {
  cell = message.cell;
  api.configure(message.config);
  let module;
  try {
    module = new vm.SourceTextModule(message.source, {
      context,
      identifier: 'exec_main.mjs',
      importModuleDynamically: unsupportedImport,
    });
  } catch (error) {
    api.complete(api.compileErrorText(error));
    stop();
    return;
  }
  try {
    await module.link(unsupportedImport);
  } catch (error) {
    api.complete(api.errorText(error));
    stop();
    return;
  }
  post({ t: 'started', cell }, true);
  let outcome = null;
  try {
    await module.evaluate();
  } catch (error) {
    outcome = api.errorText(error);
  }
  api.complete(outcome);
  stop();
}

parentPort.on('message', (batch) => {
  for (const message of batch) {
    if (message.t === 'results') api.deliver(message.json);
    else if (message.t === 'exec') runCell(message);
  }
});

// Exercise the module machinery (parse, link, evaluate, top-level await) once, on a throwaway
// module in a throwaway context, so the cell's own module does not pay first-use costs.
async function warmUp() {
  try {
    const scratch = vm.createContext({});
    const module = new vm.SourceTextModule('await 0;', { context: scratch, identifier: 'warmup.mjs' });
    await module.link(unsupportedImport);
    await module.evaluate();
  } catch (error) {
    // best effort
  }
  post({ t: 'warm' }, true);
}

warmUp();
