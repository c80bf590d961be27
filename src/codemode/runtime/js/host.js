'use strict';
// The code-mode engine host: one Node process that runs cells for a Python runtime.
//
// Started as `node [confinement flags] host.js ISOLATED_VM_DIR MEMORY_CAP_BYTES FRAMES_FD`. Each cell runs in
// its own bare V8 isolate (the isolated-vm addon): no Node object, no `process`, no `require`
// exists there, so cell code cannot reach this realm. The prelude (prelude.js) runs inside the
// isolate and talks to this file only through a few copy-only callbacks that carry primitives;
// this file stamps the cell id of every message itself (a cell cannot speak for another one).
//
// Python <-> host, over this process's stdin and the descriptor FRAMES_FD (a pipe of its own, not
// stdout: V8 prints some diagnostics a cell can provoke to stdout, which goes nowhere): a frame is
// a 4-byte little-endian length and a UTF-8 JSON array of messages (a batch). Each side writes
// everything it queued in one turn as one frame. Diagnostics go to stderr.
//
// Python -> host
//   {t:'exec', cell:int, heap:int|null, source:str, config:str, scope:int|null}
//                                                 run a cell; `config` is the prelude's JSON text,
//                                                 `scope` the session whose store it reads
//   {t:'store', scope, put:[[key, json text]]}    committed store entries of a session (Python's
//                                                 store is the authority; this is its copy here)
//   {t:'commit', cell, scope}                     Python committed the writes this host sent in
//                                                 the cell's `done`: apply them to the copy here
//   {t:'drop', cell}                              ... or it did not: forget them
//   {t:'forget', scope}                           drop a session's store (the session ended)
//   {t:'results', cell, r:'[[call_id, ok, value]]'}  settle nested tool calls: JSON text (ok=false: error text)
//   {t:'terminate', cell}                         stop the cell's isolate (works while it spins)
//
// Host -> Python (every string is well-formed UTF-16: lone surrogates become U+FFFD)
//   {t:'ready'}                                   the host is up
//   {t:'exiting'}                                 the host is about to exit (a runaway isolate)
//   {t:'started', cell}                           compiled; evaluation begins
//   {t:'item', cell, type, value, detail}         a content item (text or URL, image detail)
//   {t:'call', cell, id, tool:int, input:str|null}
//                                                 nested tool call; input is JSON text or null
//   {t:'call', cell, id, tool:int, json:<value>}  ... a long input (LARGE_CHARS), checked here
//                                                 to parse, as the JSON value itself (spliced)
//   {t:'notify', cell, text}                      notify(text)
//   {t:'yield', cell, turn:int}                   yield_control() in the cell's turn `turn`
//   {t:'done', cell, error:str|null, writes:str, call?:[tool:int, line, column]}
//                                                 completed; writes = JSON [[key, json text]]
//                                                 (each value a string holding its JSON text);
//                                                 `call`: where the failed tool call whose text
//                                                 the error is was made; long writes travel as
//                                                 `entries:[[key, json text]]` instead (spliced)
//   {t:'exited', cell, reason:'stopped'|'oom'|'crashed', detail?}
//                                                 the cell's isolate is gone (always sent, last)

const fs = require('node:fs');
const path = require('node:path');
const { performance } = require('node:perf_hooks');

for (const name of ['log', 'info', 'debug', 'warn']) console[name] = console.error;
// A cell's "use asm" functions run as the plain JavaScript they also are: V8's translation of
// them to WebAssembly (a compiler cells have no other way to reach) stays out of their reach.
require('node:v8').setFlagsFromString('--no-validate-asm');

const ivm = loadIsolatedVm(process.argv[2]);
// The heap of a cell without a heap limit; the process as a whole is watched from Python.
const MEMORY_CAP = Number(process.argv[3]) || 2 * 1024 * 1024 * 1024;
const FRAMES_FD = Number(process.argv[4]);
const PRELUDE_FILE = path.join(__dirname, 'prelude.js');
const PRELUDE = fs.readFileSync(PRELUDE_FILE, 'utf8');
// isolated-vm refuses smaller isolates; a smaller heap limit is still reported as asked.
const MIN_ISOLATE_MB = 8;
// Flush early when a batch grows large, so one frame stays far below the reader's cap; and when
// it holds many messages, which Python handles one by one in the loop iteration that reads
// their frame (a cell's flood of empty items or notifications held that loop for 0.2-0.3 s).
const FLUSH_BYTES = 8 * 1024 * 1024;
const FLUSH_MESSAGES = 1024;

function loadIsolatedVm(dir) {
  const base = path.join(dir, 'prebuilds', `${process.platform}-${process.arch}`);
  const abi = process.versions.modules;
  const names = process.platform === 'linux'
    ? [`isolated-vm.abi${abi}.glibc.node`, `isolated-vm.abi${abi}.musl.node`]
    : [`isolated-vm.abi${abi}.node`];
  let failure = null;
  for (const name of names) {
    try {
      return require(path.join(base, name)).ivm;
    } catch (error) {
      failure = error;
    }
  }
  throw new Error(`cannot load isolated-vm from ${base}: ${failure && failure.message}`);
}

// -- outbound: one frame per turn ----------------------------------------------------------------
let outbox = [];
let outboxBytes = 0;
let flushQueued = false;
let outboxSpliced = false; // the outbox holds a Spliced message

// A message with one field whose value is JSON text, written into the frame as it is: a long
// tool input or long store writes, which JSON.stringify would escape once more (a backslash
// twice over), and Python would then decode twice. The text must have been checked to parse as
// JSON (one value, nothing around it), so that it stays within its field.
class Spliced {
  constructor(message, field, json) {
    this.message = message;
    this.field = field;
    this.json = json;
  }

  toFrameText() {
    return `${JSON.stringify(this.message).slice(0, -1)},"${this.field}":${this.json}}`;
  }
}

function flush() {
  flushQueued = false;
  if (outbox.length === 0) return;
  const json = outboxSpliced
    ? `[${outbox.map((m) => (m instanceof Spliced ? m.toFrameText() : JSON.stringify(m))).join(',')}]`
    : JSON.stringify(outbox);
  outbox = [];
  outboxBytes = 0;
  outboxSpliced = false;
  // One write per frame: the reader wakes once, not once for the header and once for the body.
  const size = Buffer.byteLength(json, 'utf8');
  const frame = Buffer.allocUnsafe(4 + size);
  frame.writeUInt32LE(size, 0);
  frame.write(json, 4, 'utf8');
  // Written at once and whole (the pipe blocks while full), as stdout's pipe would be.
  for (let offset = 0; offset < frame.length;) {
    try {
      offset += fs.writeSync(FRAMES_FD, frame, offset);
    } catch (error) {
      if (error.code === 'EAGAIN') continue;
      if (error.code === 'EPIPE') {
        leave(); // Python went away: nothing is left to serve
        return;
      }
      throw error;
    }
  }
}

function send(message, bytes) {
  if (message instanceof Spliced) outboxSpliced = true;
  outbox.push(message);
  outboxBytes += bytes || 64;
  if (outboxBytes >= FLUSH_BYTES || outbox.length >= FLUSH_MESSAGES) flush();
  else if (!flushQueued) {
    flushQueued = true;
    setImmediate(flush);
  }
}

// Text leaving V8 must be valid UTF-8 downstream: replace lone surrogates.
function wellFormed(value) {
  return typeof value === 'string' ? value.toWellFormed() : '';
}

// -- cells ---------------------------------------------------------------------------------------
const DATA_URL = /^data:/i;
// One message must fit a frame Python accepts (256 MiB), however its text escapes in JSON (up to
// 6 bytes a character): a longer item is cut (past 16 Mi characters it ends its cell anyway), a
// longer error text cut as Python cuts it, and anything else too large to send refused. A large
// message travels alone in its frame (sendLarge).
const MAX_MESSAGE_BYTES = 255 * 1024 * 1024;
const LARGE_CHARS = 1024 * 1024;
// Does `text` (JSON text from the prelude, long) parse, with no escape of a surrogate (JSON.parse
// takes a lone one, Python does not: such an input travels as a string, as short ones do)? Only
// a text of few values is parsed (an object each, in this process's heap, beside the cells'
// isolates): it is long strings that are worth splicing, and any other text travels as before.
const SPLICE_MAX_VALUES = 65536;
function splicable(text) {
  if (/\\u[dD][89a-fA-F]/.test(text)) return false;
  if (text.split(',', SPLICE_MAX_VALUES + 1).length > SPLICE_MAX_VALUES) return false;
  try {
    JSON.parse(text);
    return true;
  } catch (error) {
    return false;
  }
}
function sendLarge(message, chars) {
  if (chars < LARGE_CHARS) {
    send(message, chars * 2);
    return;
  }
  flush();
  send(message, chars * 2);
  flush();
}
const MAX_ITEM_CHARS = MAX_MESSAGE_BYTES / 6;
const MAX_ERROR_CHARS = 16 * 1024 * 1024;
// Is `text`, as JSON in UTF-8, longer than `room` bytes?
function tooLarge(text, room = MAX_MESSAGE_BYTES) {
  if (text.length <= room / 6) return false;
  try {
    return Buffer.byteLength(JSON.stringify(text), 'utf8') > room;
  } catch (error) {
    return true; // longer than a string can be
  }
}
// The room an error text takes in a message (as JSON in UTF-8, at most 6 bytes a character).
function errorBytes(text) {
  if (text === null) return 0;
  return text.length <= LARGE_CHARS ? text.length * 6 : Buffer.byteLength(JSON.stringify(text), 'utf8');
}
// A cell's store writes, checked before they go (a subverted prelude sends any text): Python ends
// the engine, with every cell on it, for writes it cannot decode (not JSON, a lone surrogate
// escape), and decodes every entry into objects of its own (millions of tiny ones held the event
// loop every session shares for seconds). The prelude counts each entry 256 characters besides
// its own against the 64 Mi a cell may write, so no cell of its writes more entries than this.
const MAX_WRITE_ENTRIES = (64 * 1024 * 1024) / 256;
const WRITES_MALFORMED = 'exec cell store writes were discarded: they are malformed';
const WRITES_TOO_MANY = `exec cell store writes were discarded: more than ${MAX_WRITE_ENTRIES} entries`;
function writesRefusal(writes) {
  if (writes === '[]') return null;
  let entries;
  try {
    entries = JSON.parse(writes);
  } catch (error) {
    return WRITES_MALFORMED;
  }
  if (!Array.isArray(entries)) return WRITES_MALFORMED;
  if (entries.length > MAX_WRITE_ENTRIES) return WRITES_TOO_MANY;
  for (const entry of entries) {
    if (!Array.isArray(entry) || entry.length !== 2) return WRITES_MALFORMED;
    const [key, text] = entry;
    if (typeof key !== 'string' || typeof text !== 'string') return WRITES_MALFORMED;
    // Raw lone surrogates were replaced already; these came from escapes.
    if (!key.isWellFormed() || !text.isWellFormed()) return WRITES_MALFORMED;
  }
  return null;
}
const IMAGE_DETAILS = ['auto', 'low', 'high', 'original'];
// The prelude's own bounds, held here too (a subverted prelude gets no further): pending timers
// per cell (each a Node timer on this thread, outside the isolate's heap limit) and the length of
// a call id (Python ends an engine that sends a longer one, with every cell on it).
const MAX_TIMERS = 10000;
const MAX_CALL_ID_CHARS = 64;
const cells = new Map(); // cell -> Cell
let leaving = false; // leave() ran: the process is ending
// How long leave() lets the process end by itself before it exits regardless.
const LEAVE_GRACE_MS = 1000;
// Isolates of completed cells, disposed a turn after the spare for the next cell was made (see
// Cell.exit).
const retired = [];

function dispose(isolate) {
  try {
    isolate.dispose();
  } catch (error) {
    // already gone
  }
}

function disposeRetired() {
  while (retired.length > 0) {
    const isolate = retired.pop();
    // Disposed already, so not by this file: the isolate passed its memory limit after its cell
    // completed (code the cell left queued), which may leave its thread running (see runaway).
    if (isolate.isDisposed) runaway(null, 'an isolate passed its memory limit after its cell ended');
    dispose(isolate);
  }
}

class Cell {
  constructor(id) {
    this.id = id;
    this.isolate = null;
    this.context = null;
    this.entry = null; // Reference to the prelude's entry function
    this.timers = new Map();
    this.finished = false; // `done` was sent
    this.gone = false; // the isolate is disposed and `exited` was sent
    this.stopping = false;
    this.limit = undefined; // the memory limit (MB) this cell's isolate was made with
    this.turns = []; // the isolate's turns entered and not yet ended, in order (their promises)
    this.rewritten = false; // the cell stored after its end was reported: its writes are asked again
    this.sendDone = undefined; // sends the cell's `done` (once its end is decided)
    this.exitRequested = false; // exit() ran: `done` went out at once, the isolate is stopped
    this.exitWrites = undefined; // the writes as exit() found them, when they changed after the end
    this.store = null; // the Store this cell reads entry by entry (a large one), while it runs
    this.before = null; // key -> its text (null: absent) when the cell started, if since changed
  }

  // The store's text of `key` as it was when this cell started (null: absent).
  lookup(key) {
    if (this.store === null || typeof key !== 'string') return null;
    if (this.before.has(key)) return this.before.get(key);
    const text = this.store.entries.get(key);
    return text === undefined ? null : text;
  }

  // Runs `kind` inside the isolate. A failure here means the isolate died (memory limit,
  // disposal); the reason is reported once.
  enter(kind, a, b) {
    if (this.gone) return;
    let pending;
    try {
      pending = this.entry.apply(undefined, [kind, a, b], { arguments: { copy: true } });
    } catch (error) {
      this.failed(error);
      return;
    }
    this.turns.push(pending);
    const ended = () => this.turns.shift();
    pending.then(ended, (error) => {
      ended();
      this.failed(error);
    });
  }

  // Runs `then` once the isolate's current turn has ended: its microtasks have all run, and what
  // they sent this thread (queued before the turn's end) has been handled.
  afterTurn(then) {
    const turn = this.turns[0];
    if (turn === undefined) then();
    else turn.then(then, then);
  }

  failed(error) {
    if (this.gone) return;
    const message = String((error && error.message) || error);
    // isolated-vm reports a rejection nobody handled inside the isolate as the entry's error;
    // runtime.md ignores those. Only a dead isolate ends the cell here.
    // Not the text alone: a cell can reject with any text, "memory limit" included.
    if (this.isolate !== null && !this.isolate.isDisposed) return;
    if (/memory limit/i.test(message)) this.exit('oom');
    else if (this.stopping || this.finished) this.exit('stopped');
    else this.exit('crashed', message);
  }

  // Ends the isolate and reports why; the last message of a cell.
  exit(reason, detail) {
    if (this.gone) return;
    this.gone = true;
    cells.delete(this.id);
    if (this.store !== null) {
      this.store.readers.delete(this);
      this.store = this.before = null;
    }
    for (const handle of this.timers.values()) clearTimeout(handle);
    this.timers.clear();
    const message = { t: 'exited', cell: this.id, reason };
    if (detail !== undefined) message.detail = wellFormed(detail);
    send(message);
    // Out first: the cell's end (and its `done`) should not wait behind the disposal. Nothing
    // runs in between: this is one synchronous turn.
    flush();
    const isolate = this.isolate;
    for (const handle of [this.entry, this.context]) {
      try {
        if (handle !== null) handle.release();
      } catch (error) {
        // its isolate is gone already
      }
    }
    const completed = this.finished && !this.stopping && !this.exitRequested && reason === 'stopped';
    if (isolate !== null && !isolate.isDisposed) {
      // A cell that completed is disposed a turn later, after the spare for the next cell is
      // made and the next cell (if it came meanwhile) started; any other end disposes now.
      if (completed) retired.push(isolate);
      else dispose(isolate);
    }
    const limit = this.limit;
    if (limit !== undefined && spareTimer !== null) {
      clearTimeout(spareTimer);
      spareTimer = null;
    }
    const afterEnd = () => {
      if (limit !== undefined) prepareSpare(limit);
      // In the next turn, so that a cell sent while the spare was made starts first.
      if (retired.length > 0) setImmediate(disposeRetired);
    };
    lastEnd = performance.now();
    // Back to back the next cell comes before the spare would be ready: make it at once. When
    // cells come apart, make it once the cell's answer is on its way (see AFTER_END_MS).
    if (afterEndTimer !== null) {
      clearTimeout(afterEndTimer);
      afterEndTimer = null;
    }
    if (lastGap < PACED_GAP_MS || cells.size > 0) setImmediate(afterEnd);
    else {
      afterEndTimer = setTimeout(() => {
        afterEndTimer = null;
        afterEnd();
      }, AFTER_END_MS);
    }
  }


  // The one callback the prelude receives (one host handle per isolate: each handle costs the
  // main realm's scavenges a weak-handle visit). It runs on this thread, in the order the cell
  // made the calls, with copied primitive arguments; the first says what is asked (prelude.js
  // numbers them), and anything else is refused here, not trusted.
  callback() {
    const cell = this;
    const live = () => !cell.gone && !cell.finished;
    const item = (type, value, detail) => {
      if (!live() || typeof value !== 'string') return;
      if (type !== 'input_text' && type !== 'input_image' && type !== 'input_audio') return;
      // What the prelude checked, checked again out of the cell's reach: media are data: URLs
      // with a known detail (a cell that subverted its prelude gets nothing else out).
      if (type !== 'input_text' && !DATA_URL.test(value)) return;
      const kept = value.length > MAX_ITEM_CHARS ? value.slice(0, MAX_ITEM_CHARS) : value;
      const message = { t: 'item', cell: cell.id, type, value: wellFormed(kept) };
      if (type === 'input_image') message.detail = IMAGE_DETAILS.includes(detail) ? detail : 'high';
      sendLarge(message, kept.length);
    };
    const call = (id, tool, input) => {
      if (!live() || typeof id !== 'string' || id.length > MAX_CALL_ID_CHARS) return;
      if (!Number.isSafeInteger(tool)) return;
      const text = typeof input === 'string' ? wellFormed(input) : null;
      if (text !== null && tooLarge(text)) { // refused here, as the call's rejection
        const refusal = `tool input of ${text.length} characters is too large to send`;
        cell.enter('deliver', JSON.stringify([[id, false, refusal]]));
        return;
      }
      const message = { t: 'call', cell: cell.id, id: wellFormed(id), tool };
      if (text !== null && text.length >= LARGE_CHARS && splicable(text)) {
        sendLarge(new Spliced(message, 'json', text), text.length);
        return;
      }
      message.input = text;
      sendLarge(message, text === null ? 32 : text.length);
    };
    const notify = (text) => {
      if (!live() || typeof text !== 'string') return;
      if (tooLarge(text)) {
        console.error(`codemode engine host: a notification of ${text.length} characters dropped`);
        return;
      }
      sendLarge({ t: 'notify', cell: cell.id, text: wellFormed(text) }, text.length);
    };
    const yieldTurn = (turn) => {
      if (!live() || !Number.isSafeInteger(turn)) return;
      send({ t: 'yield', cell: cell.id, turn });
    };
    const finish = (error, writes, tool, line, column) => {
      if (!live() || cell.ending) return;
      cell.ending = true;
      let text = error === null ? null : String(error);
      if (text !== null && text.length > MAX_ERROR_CHARS) { // Python's cut, made before sending
        text = `${text.slice(0, MAX_ERROR_CHARS)}\n… (error text cut: ${text.length} characters in all)`;
      }
      if (text !== null) text = wellFormed(text);
      const done = { t: 'done', cell: cell.id, error: text, writes: wellFormed(writes) };
      if (text !== null && Number.isSafeInteger(tool) && Number.isSafeInteger(line) &&
          Number.isSafeInteger(column) && line > 0 && column > 0) {
        done.call = [tool, line, column];
      }
      // The turn that decided the end runs its leftover microtasks first (their items are
      // part of the result, as upstream's): `done` goes out when that turn has ended — or at
      // once on exit() (see exitNow).
      cell.sendDone = () => {
        if (!live()) return;
        cell.finished = true;
        if (cell.exitWrites !== undefined) {
          // read by the prelude at exit(): its isolate may be busy
          done.writes = wellFormed(cell.exitWrites);
        } else if (cell.rewritten) { // a leftover microtask stored more: the writes as they are now
          try {
            const now = cell.entry.applySync(undefined, ['writes'], { result: { copy: true } });
            if (typeof now === 'string') done.writes = wellFormed(now);
          } catch (error) {
            // the isolate is gone: what the end reported stands
          }
        }
        const refusal = writesRefusal(done.writes);
        if (refusal !== null) {
          done.writes = '[]';
          done.error = refusal;
          delete done.call;
        }
        // The writes share the frame with the error text (up to 16 Mi characters of it).
        if (tooLarge(done.writes, MAX_MESSAGE_BYTES - 1024 - errorBytes(done.error))) {
          done.writes = '[]';
          done.error = 'exec cell store writes were discarded: they are too large to send';
          delete done.call;
        }
        // Kept until Python commits them (or not): it then names them rather than send them
        // back (a 60 M-character value cost its event loop, which every session shares, 0.1 s
        // to encode again).
        if (done.writes !== '[]') pendingWrites.set(cell.id, done.writes);
        const chars = done.writes.length + (done.error === null ? 0 : done.error.length);
        if (done.writes.length >= LARGE_CHARS) { // parsed and checked by writesRefusal
          const writes = done.writes;
          delete done.writes;
          sendLarge(new Spliced(done, 'entries', writes), chars);
        } else {
          sendLarge(done, chars);
        }
        cell.exit('stopped');
      };
      cell.afterTurn(cell.sendDone);
    };
    // exit() (runtime.md §9) cannot be caught: nothing of the cell runs after it. The prelude's
    // EXIT is an exception a cell can catch (or outlive in a `finally`), so the end is not left
    // to the turn's end, which such a cell may never reach (a `catch` in a loop): `done` goes out
    // now and the isolate is stopped, wherever its code is.
    const exitNow = (writes) => {
      if (!live() || !cell.ending || cell.sendDone === undefined) return;
      if (cell.rewritten && typeof writes === 'string') cell.exitWrites = writes;
      cell.exitRequested = true;
      cell.sendDone();
    };
    const setTimer = (id, ms) => {
      if (!live() || !Number.isSafeInteger(id) || typeof ms !== 'number') return;
      const replaced = cell.timers.get(id);
      if (replaced !== undefined) clearTimeout(replaced); // one timer per id, not one left behind
      else if (cell.timers.size >= MAX_TIMERS) return;
      cell.timers.set(id, setTimeout(() => {
        cell.timers.delete(id);
        cell.enter('timer', id);
      }, Math.min(Math.max(ms, 0), 0x7fffffff)));
    };
    const clearTimer = (id) => {
      const handle = cell.timers.get(id);
      if (handle !== undefined) {
        clearTimeout(handle);
        cell.timers.delete(id);
      }
    };
    const rewritten = () => {
      if (live()) cell.rewritten = true;
    };
    return new ivm.Callback((kind, a, b, c, d, e) => {
      switch (kind) {
        case 0: item(a, b, c); break;
        case 1: call(a, b, c); break;
        case 2: notify(a); break;
        case 3: yieldTurn(a); break;
        case 4: finish(a, b, c, d, e); break;
        case 5: setTimer(a, b); break;
        case 6: clearTimer(a); break;
        case 7: rewritten(); break;
        case 8: exitNow(a); break;
        default: break;
      }
    }, { ignored: true });
  }
}

// The cell runs as the body of an async function (so the prelude can observe how it ends and
// turn what it threw into text inside the isolate). The header shares the source's first line and
// is taken off its columns (columnOffset), so that every line and column, an eval's origin and
// the lines under a `//# sourceURL` are those of the source the model wrote.
// The renamed dynamic imports (see renameDynamicImports) resolve to the wrapper's parameter, not
// to a global.
const WRAP_HEAD = "(function ($imprt) { return async function () {'use strict';";
const WRAP_TAIL = '\n}; })';
// V8 takes no offset off the positions of a script that names itself with a `//# sourceURL`
// comment: its frames on the first line count the header's columns. The prelude takes them off
// the cell's error texts, given the name V8 took, which V8 itself tells: the same body under a
// header that reads its own stack, compiled under a file name no sourceURL can be (it holds a
// space). Only for a source that mentions sourceURL.
const PROBE_HEAD = "[new Error().stack, async function () {'use strict';";
const PROBE_TAIL = '\n}][0]';
const PROBE_FILE = 'no source url';
const PROBE_FRAME = /^Error\n    at (.+):1:\d+$/;

// The name the cell's script reports its frames by when the source names it, else null.
function sourceUrlOf(cell, body) {
  if (!body.includes('sourceURL')) return null;
  try {
    const probe = cell.isolate.compileScriptSync(PROBE_HEAD + body + PROBE_TAIL, {
      filename: PROBE_FILE,
    });
    const stack = probe.runSync(cell.context, { copy: true });
    probe.release();
    const frame = PROBE_FRAME.exec(String(stack));
    return frame !== null && frame[1] !== PROBE_FILE ? frame[1] : null;
  } catch (ignored) {
    return null;
  }
}

// A fresh isolate with the prelude installed, made while nothing waits for it: the next cell
// with the same memory limit takes it (each isolate still serves exactly one cell).
// One spare is made after each cell; a second only after a quiet while (IDLE_SPARE_MS without a
// cell), when its making competes with nothing: the first two cells after a pause (an agent's
// burst after its model's turn) then both find one. Back to back the second cell came before the
// first's spare, deferred by AFTER_END_MS, was made, and made its isolate itself (+1.3 ms).
// Spares of two limits may be kept (sessions of a shared engine with limits of their own).
let spares = []; // { limit, cell }, oldest first
const MAX_SPARES = 2;
const IDLE_SPARE_MS = 50;
let idleSpareTimer = null;
const SPARE_DELAY_MS = 20;
let spareTimer = null; // makes the spare while cells run on (cleared when one ends)
// The spare (≈1.3 ms on this thread) and the disposal of the completed cell's isolate, made at
// once when a cell ends, compete for the CPU with the processes that carry the cell's answer to
// the client (the Python host, the client): on 2 cores with other work, one of them then waits
// for a CPU for a scheduler slice (2–5 ms; decision 0013). When the previous cell came a while
// after the one before it ended (cells paced, not back to back), that work waits AFTER_END_MS,
// so the answer is delivered first; an exec that comes meanwhile cancels the wait.
const AFTER_END_MS = 2;
const PACED_GAP_MS = 5; // AFTER_END_MS + the spare's making + margin: the spare is ready in time
let afterEndTimer = null;
let lastEnd = -Infinity; // when the last cell ended (performance.now())
let lastGap = Infinity; // from that end to the exec that followed it, ms
// V8's code cache of the prelude, made by this process from its own first compile of it. Cells
// are compiled with --no-lazy (switched on at the end of this file), so the cache holds every
// prelude function: an isolate deserializes them (0.08 ms) instead of compiling the prelude
// (0.3 ms) and, during its cell, each function the cell uses (0.2 ms more).
let preludeCache = null;

function prepare(limit) {
  const cell = new Cell(null);
  cell.isolate = new ivm.Isolate({ memoryLimit: limit });
  cell.context = cell.isolate.createContextSync();
  const prelude = cell.isolate.compileScriptSync(PRELUDE, preludeCache === null
    ? { filename: 'codemode-prelude.js', produceCachedData: true }
    : { filename: 'codemode-prelude.js', cachedData: preludeCache });
  if (preludeCache === null) preludeCache = prelude.cachedData || null;
  else if (prelude.cachedDataRejected) preludeCache = null; // made anew by the next compile
  const install = prelude.runSync(cell.context, { reference: true });
  cell.entry = install.applySync(undefined, [cell.callback(), WRAP_HEAD.length],
    { result: { reference: true } });
  // Handles released as soon as they are spent: each one left to the main realm's collector
  // is a weak handle its scavenges visit (they were most of a scavenge's pause).
  install.release();
  prelude.release();
  return cell;
}

// Makes spares of `limit` until there are `count`, dropping the oldest of other limits to stay
// within MAX_SPARES.
function prepareSpare(limit, count = 1) {
  if (leaving) return;
  try {
    while (spares.filter((spare) => spare.limit === limit).length < count) {
      if (spares.length >= MAX_SPARES) {
        const other = spares.findIndex((spare) => spare.limit !== limit);
        if (other < 0) break;
        dispose(spares.splice(other, 1)[0].cell.isolate); // its handles go with it
      }
      spares.push({ limit, cell: prepare(limit) });
    }
  } catch (error) {
    console.error(`codemode engine host: cannot prepare an isolate: ${error && error.message}`);
    return;
  }
  if (idleSpareTimer !== null) clearTimeout(idleSpareTimer);
  idleSpareTimer = count < MAX_SPARES ? setTimeout(() => {
    idleSpareTimer = null;
    if (cells.size === 0) prepareSpare(limit, MAX_SPARES);
  }, IDLE_SPARE_MS) : null;
}

function takeIsolate(limit) {
  if (idleSpareTimer !== null) {
    clearTimeout(idleSpareTimer);
    idleSpareTimer = null;
  }
  for (let i = spares.length - 1; i >= 0; i--) {
    if (spares[i].limit !== limit) continue;
    const cell = spares.splice(i, 1)[0].cell;
    if (!cell.isolate.isDisposed) return cell;
  }
  return prepare(limit);
}

// -- stores --------------------------------------------------------------------------------------
// Each session's store lives here as well as in Python, which sends what it commits (and all of it
// to a new engine; a commit of writes this host sent is only named): an exec then carries no
// store, however large it grew. A cell reads the store
// as it was when it started (runtime.md §6). A small store is given to the cell whole, as one
// JSON text; from a larger one the cell fetches each key it loads (a synchronous call to this
// thread, ≈50 µs), so that its start costs nothing in proportion to the store. A commit made
// while such cells run keeps, for each of them, what it overwrote (Cell.before): work in
// proportion to the commit, not to the store.
const stores = new Map(); // scope -> Store
// The writes (JSON text, checked by writesRefusal) of each cell whose `done` carried some, until
// Python says whether it committed them (`commit`, `drop`).
const pendingWrites = new Map(); // cell id -> writes
const WHOLE_STORE_CHARS = 64 * 1024;

class Store {
  constructor() {
    this.entries = new Map(); // key -> JSON text
    this.chars = 0;
    this.readers = new Set(); // running cells that fetch keys from this store
    this.whole = undefined; // the entries as one JSON text (null: too large), made on demand
  }

  put(entries) {
    for (const [key, text] of entries) {
      const old = this.entries.get(key);
      for (const cell of this.readers) {
        if (!cell.before.has(key)) cell.before.set(key, old === undefined ? null : old);
      }
      this.entries.set(key, text);
      this.chars += key.length + text.length - (old === undefined ? 0 : key.length + old.length);
    }
    this.whole = undefined;
  }

  wholeText() {
    if (this.whole === undefined) {
      this.whole = this.chars <= WHOLE_STORE_CHARS ? JSON.stringify([...this.entries]) : null;
    }
    return this.whole;
  }
}

function storeOf(scope) {
  let store = stores.get(scope);
  if (store === undefined) stores.set(scope, store = new Store());
  return store;
}

function exec(message) {
  lastGap = performance.now() - lastEnd;
  if (afterEndTimer !== null) { // came early: the spare is made when a cell ends
    clearTimeout(afterEndTimer);
    afterEndTimer = null;
    if (retired.length > 0) setImmediate(disposeRetired);
  }
  const heap = message.heap;
  // A heap limit above the process's memory cap could never be reached (and one near 2^64 bytes
  // overflows isolated-vm's arithmetic): the cap bounds it.
  const capMb = Math.max(MIN_ISOLATE_MB, Math.floor(MEMORY_CAP / (1024 * 1024)));
  const limit = heap === null || heap === undefined
    ? capMb
    : Math.min(Math.max(MIN_ISOLATE_MB, heap), capMb);
  let cell;
  try {
    cell = takeIsolate(limit);
  } catch (error) {
    cell = new Cell(null);
    cell.id = message.cell;
    cell.exit('crashed', `cannot create an isolate: ${error && error.message}`);
    return;
  }
  cell.id = message.cell;
  cell.limit = limit;
  cells.set(cell.id, cell);
  // Not at once: this thread must be free to forward the cell's first output and its end. The
  // spare is made when a cell ends, or after a while if none has ended by then: one timer, not
  // one per cell (a cell's old timer would make a spare in the middle of a later cell).
  if (spareTimer === null) {
    spareTimer = setTimeout(() => {
      spareTimer = null;
      prepareSpare(limit);
    }, SPARE_DELAY_MS);
  }
  // The store the cell reads: whole (a JSON text), or key by key through `fetch`.
  let whole = null;
  let fetch = null;
  if (Number.isSafeInteger(message.scope)) {
    const store = storeOf(message.scope);
    whole = store.wholeText();
    if (whole === null) {
      cell.store = store;
      cell.before = new Map();
      store.readers.add(cell);
      fetch = new ivm.Callback((key) => cell.lookup(key));
    }
  }
  try {
    cell.entry.applySync(undefined, ['configure', message.config, whole, fetch],
      { arguments: { copy: true } });
  } catch (error) {
    cell.exit(/memory limit/i.test(String(error && error.message)) ? 'oom' : 'crashed',
      String((error && error.message) || error));
    return;
  }
  let error = null;
  let fn = null;
  let sourceUrl = null;
  try {
    // As a module first: its parser's verdict (syntax, static imports) is the one that counts.
    const module = cell.isolate.compileModuleSync(message.source, { filename: 'exec_main.mjs' });
    const imports = module.dependencySpecifiers;
    if (imports.length > 0) error = `Unsupported import in exec: ${imports[0]}`;
    module.release();
  } catch (thrown) {
    error = compileErrorText(thrown);
  }
  if (error === null) {
    try {
      // A module may start with a hashbang line (the check above accepted it); a function body
      // may not: it becomes a comment of the same length.
      const source = message.source.startsWith('#!')
        ? '//' + message.source.slice(2) : message.source;
      const body = renameDynamicImports(source);
      const script = cell.isolate.compileScriptSync(WRAP_HEAD + body + WRAP_TAIL, {
        filename: 'exec_main.mjs',
        columnOffset: -WRAP_HEAD.length,
      });
      fn = script.runSync(cell.context, { reference: true });
      script.release();
      sourceUrl = sourceUrlOf(cell, body);
    } catch (thrown) {
      // Valid as a module but not as a function body (`export`, `import.meta`): not a cell.
      error = compileErrorText(thrown);
    }
  }
  if (error !== null) {
    cell.enter('fail', error);
    return;
  }
  send({ t: 'started', cell: cell.id });
  cell.enter('run', fn.derefInto(), sourceUrl);
  fn.release(); // what derefInto passed is the isolate's own now
}

// V8 in a bare isolate rejects `import(x)` with its own "Not supported" error; cells must see
// the runtime's text instead. Each dynamic import in the code (not in strings, comments, regular
// expressions or template text) is renamed to a same-length parameter of the cell's wrapper, so
// lines and columns stay those of the source. One linear pass; a `/` is read as the start of a
// regular expression unless it follows a value.
const DYNAMIC_IMPORT = '$imprt';
const ID_START = /[A-Za-z_$\u0080-\uffff]/;
const ID_PART = /[A-Za-z0-9_$\u0080-\uffff]/;
const VALUE_KEYWORDS = new Set(['this', 'super', 'null', 'true', 'false', 'undefined']);

function renameDynamicImports(source) {
  if (!source.includes('import')) return source;
  const imports = []; // where each dynamic import to rename starts
  const parens = []; // for each open parenthesis: where the `import` before it starts, or -1
  const conditions = []; // for each open parenthesis: does it follow `if`, `while`, `for`, `with`?
  let importBefore = -1; // an `import` whose `(` comes next
  let keywordBefore = false; // an `if`, `while`, `for` or `with` whose `(` comes next
  let dotBefore = false; // a `.` came last (blanks and comments aside): a word is a property
  let i = 0;
  let valueBefore = false; // does a `/` here divide (true) or start a regular expression?
  const templates = []; // brace depths at which a template literal's `${` was opened
  let depth = 0;
  const n = source.length;
  const skipString = (quote) => {
    i++;
    while (i < n && source[i] !== quote) i += source[i] === '\\' ? 2 : 1;
    i++;
  };
  const skipTemplate = () => { // from just after ` or }, to just after ` or ${
    while (i < n) {
      const c = source[i];
      if (c === '\\') i += 2;
      else if (c === '`') { i++; return; }
      else if (c === '$' && source[i + 1] === '{') { i += 2; templates.push(depth); depth++; return; }
      else i++;
    }
  };
  while (i < n) {
    const c = source[i];
    const keyword = keywordBefore; // both kept over blanks and comments only
    const dot = dotBefore;
    keywordBefore = false;
    dotBefore = false;
    if (c === '/' && source[i + 1] === '/') {
      while (i < n && source[i] !== '\n') i++;
      keywordBefore = keyword;
      dotBefore = dot;
    } else if (c === '/' && source[i + 1] === '*') {
      const end = source.indexOf('*/', i + 2);
      i = end < 0 ? n : end + 2;
      keywordBefore = keyword;
      dotBefore = dot;
    } else if (c === '"' || c === "'") {
      skipString(c);
      valueBefore = true;
    } else if (c === '`') {
      i++;
      skipTemplate();
      valueBefore = true;
    } else if (c === '/') {
      if (valueBefore) {
        i++;
        valueBefore = false;
      } else {
        i++;
        let inClass = false;
        while (i < n && source[i] !== '\n') {
          const r = source[i];
          if (r === '\\') i++;
          else if (r === '[') inClass = true;
          else if (r === ']') inClass = false;
          else if (r === '/' && !inClass) break;
          i++;
        }
        i++;
        while (i < n && ID_PART.test(source[i])) i++;
        valueBefore = true;
      }
    } else if (ID_START.test(c)) {
      const start = i;
      while (i < n && ID_PART.test(source[i])) i++;
      const word = source.slice(start, i);
      if (word === 'import' && !dot) {
        let j = i;
        for (;;) {
          while (j < n && /\s/.test(source[j])) j++;
          if (source[j] === '/' && source[j + 1] === '*') {
            const end = source.indexOf('*/', j + 2);
            j = end < 0 ? n : end + 2;
          } else if (source[j] === '/' && source[j + 1] === '/') {
            while (j < n && source[j] !== '\n') j++;
          } else break;
        }
        // `import(...) {` is a method named import (`{ import(x) {} }`, `get import() {}`):
        // a call is never followed by a block. Decided when this pass reaches the closing
        // parenthesis (a scan ahead from every `import(` would make a cell whose source nests
        // them, or hides a `(` from such a scan, stall this thread quadratically).
        if (source[j] === '(') importBefore = start;
      }
      // After `if (…)` comes a statement, which may start with a regular expression.
      keywordBefore = !dot &&
        (word === 'if' || word === 'while' || word === 'for' || word === 'with' ||
          (keyword && word === 'await')); // for await (…)
      valueBefore = VALUE_KEYWORDS.has(word) || !/^(return|typeof|instanceof|in|of|new|delete|void|throw|case|do|else|yield|await)$/.test(word);
    } else if (c >= '0' && c <= '9') {
      while (i < n && ID_PART.test(source[i])) i++;
      valueBefore = true;
    } else if (c === '{') {
      depth++;
      i++;
      valueBefore = false;
    } else if (c === '}') {
      i++;
      if (templates.length > 0 && templates[templates.length - 1] === depth - 1) {
        templates.pop();
        depth--;
        skipTemplate();
        valueBefore = true;
      } else {
        depth--;
        valueBefore = false;
      }
    } else if (c === '(') {
      parens.push(importBefore);
      conditions.push(keyword);
      importBefore = -1;
      i++;
      valueBefore = false;
    } else if (c === ')' || c === ']') {
      i++;
      valueBefore = true;
      if (c === ')' && parens.length > 0) {
        const opened = parens.pop();
        if (opened >= 0 && !startsBlock(source, i)) imports.push(opened);
        if (conditions.pop()) valueBefore = false;
      }
    } else if (/\s/.test(c)) {
      i++;
      keywordBefore = keyword;
      dotBefore = dot;
    } else if ((c === '+' || c === '-') && source[i + 1] === c) {
      i += 2; // after a value it is postfix and a value still ends here (`i++ / 2` divides)
    } else {
      i++;
      valueBefore = false;
      dotBefore = c === '.' || (c === '?' && source[i] === '.'); // `a.b`, `a?.b`
      if (dotBefore && c === '?') i++;
    }
  }
  for (const opened of parens) if (opened >= 0) imports.push(opened); // never closed: a call
  if (imports.length === 0) return source;
  imports.sort((a, b) => a - b);
  const out = [];
  let last = 0;
  for (const start of imports) {
    out.push(source.slice(last, start), DYNAMIC_IMPORT);
    last = start + 'import'.length;
  }
  out.push(source.slice(last));
  return out.join('');
}

// Does a block (`{`) come at `i`, after blanks and comments?
function startsBlock(source, i) {
  for (;;) {
    while (i < source.length && /\s/.test(source[i])) i++;
    if (source[i] === '/' && source[i + 1] === '*') {
      const end = source.indexOf('*/', i + 2);
      i = end < 0 ? source.length : end + 2;
    } else if (source[i] === '/' && source[i + 1] === '/') {
      while (i < source.length && source[i] !== '\n') i++;
    } else return source[i] === '{';
  }
}

function compileErrorText(error) {
  // "SyntaxError: Unexpected token ';' [exec_main.mjs:1:9]" -> keep the engine's text and place.
  const message = String((error && error.message) || error);
  const name = error && typeof error.name === 'string' ? error.name : 'SyntaxError';
  const text = message.startsWith(name) ? message : `${name}: ${message}`;
  return text.replace(/ \[exec_main\.mjs:(\d+):(\d+)\]$/, ' (exec_main.mjs:$1:$2)');
}

function terminate(id) {
  const cell = cells.get(id);
  if (cell === undefined) {
    send({ t: 'exited', cell: id, reason: 'stopped' });
    return;
  }
  cell.stopping = true;
  // The cell's code stops now; its end is reported once what it made before the stop (items
  // queued for this thread by its isolate) has been forwarded, as part of its `Terminated`: the
  // rejection of an entry in flight comes after them (failed() then ends the cell), and two
  // turns later (one poll of this thread's queue in between) it ends anyway.
  if (cell.isolate !== null && !cell.isolate.isDisposed) dispose(cell.isolate);
  setImmediate(() => setImmediate(() => cell.exit('stopped')));
}

// -- runaway isolates ----------------------------------------------------------------------------
// isolated-vm disposes an isolate that passes its memory limit, but some allocation patterns keep
// its thread running (and allocating) in the disposed isolate, where nothing can stop it. Such a
// cell is reported as over its heap limit, then this process ends: only a new process stops that
// thread (the session's next cell gets a fresh engine).
const RUNAWAY_CHECK_MS = 50;
setInterval(() => {
  if (leaving) return; // the isolates were all stopped: leave() bounds what is left of them
  for (const cell of cells.values()) {
    if (cell.gone || cell.isolate === null || !cell.isolate.isDisposed) continue;
    if (!cell.disposedSeen) {
      cell.disposedSeen = true; // give the normal path (a rejected entry) one tick to report
      continue;
    }
    runaway(cell, 'a disposed isolate kept running');
  }
}, RUNAWAY_CHECK_MS).unref();

function runaway(cell, why) {
  send({ t: 'exiting' }); // before the cell's end, so that no new cell is sent here
  if (cell !== null) cell.exit('oom');
  flush();
  console.error(`codemode engine host: ${why}; exiting`);
  process.exit(70);
}

// -- inbound -------------------------------------------------------------------------------------
function onBatch(batch) {
  for (const message of batch) {
    switch (message.t) {
      case 'results': {
        const cell = cells.get(message.cell);
        if (cell === undefined || cell.stopping) break; // late: the cell is gone
        cell.enter('deliver', String(message.r)); // JSON text, parsed in the isolate
        break;
      }
      case 'exec':
        exec(message);
        break;
      case 'terminate':
        terminate(message.cell);
        break;
      case 'store':
        storeOf(message.scope).put(message.put);
        break;
      case 'commit': {
        const writes = pendingWrites.get(message.cell);
        pendingWrites.delete(message.cell);
        if (writes !== undefined) storeOf(message.scope).put(JSON.parse(writes));
        break;
      }
      case 'drop':
        pendingWrites.delete(message.cell);
        break;
      case 'forget':
        stores.delete(message.scope);
        break;
      default:
        console.error(`codemode engine host: unknown message ${message.t}`);
    }
  }
}

// Input frames are reassembled from a list of chunks: one copy per frame, not one per chunk.
let chunks = [];
let buffered = 0;
let wanted = -1; // size of the frame being read, or -1 while its header is incomplete

function take(size) {
  const out = chunks.length === 1 && chunks[0].length === size ? chunks[0] : Buffer.concat(chunks, buffered);
  const head = out.subarray(0, size);
  const rest = out.subarray(size);
  chunks = rest.length > 0 ? [rest] : [];
  buffered = rest.length;
  return head;
}

process.stdin.on('data', (chunk) => {
  chunks.push(chunk);
  buffered += chunk.length;
  for (;;) {
    if (wanted < 0) {
      if (buffered < 4) return;
      wanted = take(4).readUInt32LE(0);
    }
    if (buffered < wanted) return;
    const body = take(wanted);
    wanted = -1;
    onBatch(JSON.parse(body.toString('utf8')));
  }
});
// The runtime went away: nothing is left to serve.
process.stdin.on('end', () => {
  flush();
  leave();
});

// Ends the process. process.exit() waits for every isolate's thread, and a cell in a loop for
// ever never lets go of its own: the isolates are stopped first. A stopped isolate's thread then
// unwinds for a while, and exiting meanwhile crashed the process (SIGSEGV, 1 run in 2 on a loaded
// machine; 1 in 8 even after its entry settled). So nothing is left to keep the process alive
// but the isolates, and it ends by itself once their threads are done (isolated-vm holds the
// event loop until then); the timer, which does not hold it, bounds a thread that never ends.
function leave() {
  if (leaving) return;
  leaving = true;
  process.stdin.destroy();
  for (const handle of [spareTimer, idleSpareTimer, afterEndTimer]) {
    if (handle !== null) clearTimeout(handle);
  }
  for (const cell of cells.values()) {
    for (const handle of cell.timers.values()) clearTimeout(handle);
    if (cell.isolate !== null) dispose(cell.isolate);
  }
  for (const spare of spares) dispose(spare.cell.isolate);
  spares = [];
  setTimeout(() => process.exit(0), LEAVE_GRACE_MS).unref();
}

send({ t: 'ready' });

// From here on functions are compiled with their script: the prelude's code cache then holds all
// of its bytecode, not its top level only, so a cell's isolate does not compile the prelude's
// functions again (≈0.2 ms of every cell; decision 0013). Switched on only now: on the command
// line it would make Node refuse its own built-in code cache (the flags differ from those it was
// made with) and compile its bootstrap from source, ≈13 ms of every engine's start.
require('node:v8').setFlagsFromString('--no-lazy');
