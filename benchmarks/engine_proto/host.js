'use strict';
/*
 * Code-mode Node engine host (prototype).
 *
 * One Node process per engine, started by Python as
 *     node --experimental-vm-modules --disable-warning=ExperimentalWarning host.js
 * Each cell runs in its own worker_threads Worker (own V8 isolate, own heap limit,
 * terminable while spinning), evaluated as an ES module inside a fresh vm context.
 * Warm workers are spawned ahead of time so `exec` does not pay isolate start-up.
 *
 * Wire protocol (Python <-> host), over the child's stdin/stdout:
 *   frame   = uint32 big-endian byte length + UTF-8 JSON text
 *   payload = JSON array of messages (a batch). Each side queues messages and writes
 *             one frame per event-loop turn carrying everything queued in that turn.
 *   stdout carries frames only; diagnostics go to stderr (console.* is redirected).
 *
 * Python -> host
 *   {t:'pool', heap_mb:int|null, size:int}        keep `size` warm workers for this heap limit
 *   {t:'exec', cell:str, src:str, tools:[str], heap_mb:int|null}
 *                                                  run `src` as module exec_main.mjs
 *   {t:'result', cell, call:str, ok:bool, value:any}
 *                                                  settle nested call `call` (ok=false: value
 *                                                  is the error text; JS sees a plain string)
 *   {t:'terminate', cell}                          stop the cell's isolate (runaway-safe)
 *   {t:'eval', id:any, src:str}                    baseline: vm.runInThisContext on the main
 *                                                  thread, replies {t:'evaled', id, value}
 *   {t:'ping', id:any}                             replies {t:'pong', id}
 *
 * Host -> Python
 *   {t:'ready', pid}                               host loaded
 *   {t:'warm', heap_mb, ready:int}                 a pool worker finished its bootstrap
 *   {t:'started', cell}                            module linked, evaluation begins
 *   {t:'call', cell, call:'tool-N', tool:str, input:str|undefined}
 *                                                  nested tool call; `input` is JSON text,
 *                                                  absent when JS passed no input
 *   {t:'text', cell, text:str}                     output helper (prototype: text only)
 *   {t:'done', cell, error:str|null}               module promise settled (cell completed)
 *   {t:'exited', cell, reason:'terminated'|'oom'|'crashed', detail?:str}
 *                                                  the cell's isolate is gone; for 'oom' and
 *                                                  'crashed' no 'done' was sent
 *   {t:'evaled', id, value} / {t:'pong', id}
 */

const { Worker } = require('node:worker_threads');
const path = require('node:path');
const vm = require('node:vm');

for (const k of ['log', 'info', 'debug', 'warn']) console[k] = console.error;

const WORKER_FILE = path.join(__dirname, 'worker.js');

// ---- outbound framing + per-turn batching --------------------------------------------
let outbox = [];
let flushQueued = false;
function flush() {
  flushQueued = false;
  const body = Buffer.from(JSON.stringify(outbox), 'utf8');
  outbox = [];
  const head = Buffer.allocUnsafe(4);
  head.writeUInt32BE(body.length, 0);
  process.stdout.write(Buffer.concat([head, body]));
}
function send(msg) {
  outbox.push(msg);
  if (!flushQueued) {
    flushQueued = true;
    setImmediate(flush); // after this turn's I/O callbacks: one frame for all workers
  }
}

// ---- workers -------------------------------------------------------------------------
/** heap key -> array of warm (bootstrapped, idle) workers */
const warm = new Map();
/** heap key -> wanted pool size */
const poolSize = new Map();
/** cell id -> {worker, terminating} */
const cells = new Map();

function heapKey(heapMb) {
  return heapMb == null ? 'none' : String(heapMb);
}

function spawnWorker(heapMb) {
  // stdout: true keeps a worker's stray writes off the protocol stream; send them to stderr
  const opts = { stdout: true, stderr: false };
  if (heapMb != null) {
    // old space carries the limit; young space is capped small so the total stays close
    opts.resourceLimits = {
      maxOldGenerationSizeMb: heapMb,
      maxYoungGenerationSizeMb: Math.max(1, Math.min(16, Math.floor(heapMb / 4))),
    };
  }
  const w = new Worker(WORKER_FILE, opts);
  w.stdout.pipe(process.stderr);
  w.cell = null;
  w.isWarm = false;
  w.heapMb = heapMb;
  w.oom = false;
  w.on('message', (batch) => onWorkerBatch(w, batch));
  w.on('error', (err) => {
    if (err && err.code === 'ERR_WORKER_OUT_OF_MEMORY') w.oom = true;
    w.lastError = String((err && err.stack) || err);
  });
  w.on('exit', () => onWorkerExit(w));
  return w;
}

function refill(heapMb) {
  const key = heapKey(heapMb);
  const want = poolSize.get(key) || 0;
  const list = warm.get(key) || [];
  warm.set(key, list);
  // count workers still booting so we do not overshoot
  let booting = 0;
  for (const w of allWorkers) if (!w.isWarm && w.cell === null && heapKey(w.heapMb) === key) booting++;
  for (let i = list.length + booting; i < want; i++) allWorkers.add(spawnWorker(heapMb));
}
const allWorkers = new Set();

function onWorkerBatch(w, batch) {
  for (const m of batch) {
    if (m.t === 'warm') {
      w.isWarm = true;
      if (w.pendingExec) {
        const e = w.pendingExec;
        w.pendingExec = null;
        w.postMessage([e]);
      } else {
        const list = warm.get(heapKey(w.heapMb)) || [];
        list.push(w);
        warm.set(heapKey(w.heapMb), list);
        send({ t: 'warm', heap_mb: w.heapMb, ready: list.length });
      }
      continue;
    }
    send(m);
    if (m.t === 'done') {
      cells.delete(m.cell);
      w.cell = null;
      w.finished = true;
      w.terminate(); // one isolate per cell; off the critical path
    }
  }
}

function onWorkerExit(w) {
  allWorkers.delete(w);
  const key = heapKey(w.heapMb);
  const list = warm.get(key);
  if (list) {
    const i = list.indexOf(w);
    if (i >= 0) list.splice(i, 1);
  }
  if (w.cell !== null) {
    const cell = w.cell;
    const c = cells.get(cell);
    cells.delete(cell);
    if (c && c.terminating) send({ t: 'exited', cell, reason: 'terminated' });
    else if (w.oom) send({ t: 'exited', cell, reason: 'oom' });
    else send({ t: 'exited', cell, reason: 'crashed', detail: w.lastError || 'worker exited' });
  }
  refill(w.heapMb);
}

function exec(m) {
  const key = heapKey(m.heap_mb);
  const list = warm.get(key) || [];
  let w = list.shift();
  const msg = { t: 'exec', cell: m.cell, src: m.src, tools: m.tools || [] };
  if (w === undefined) {
    w = spawnWorker(m.heap_mb); // cold start: pays isolate + bootstrap
    allWorkers.add(w);
    w.pendingExec = msg;
  } else {
    w.postMessage([msg]);
  }
  w.cell = m.cell;
  cells.set(m.cell, { worker: w, terminating: false });
  refill(m.heap_mb);
}

// ---- inbound ---------------------------------------------------------------------------
function onBatch(batch) {
  const results = new Map(); // worker -> [[call, ok, value]]
  for (const m of batch) {
    switch (m.t) {
      case 'result': {
        const c = cells.get(m.cell);
        if (!c) break; // late result for a finished cell: discarded
        let arr = results.get(c.worker);
        if (!arr) results.set(c.worker, (arr = []));
        arr.push([m.call, m.ok, m.value]);
        break;
      }
      case 'exec':
        exec(m);
        break;
      case 'terminate': {
        const c = cells.get(m.cell);
        if (c && !c.terminating) {
          c.terminating = true;
          c.worker.terminate();
        }
        break;
      }
      case 'pool':
        poolSize.set(heapKey(m.heap_mb), m.size);
        refill(m.heap_mb);
        break;
      case 'eval': {
        let value;
        try {
          value = vm.runInThisContext(m.src);
        } catch (e) {
          value = String(e);
        }
        send({ t: 'evaled', id: m.id, value });
        break;
      }
      case 'ping':
        send({ t: 'pong', id: m.id });
        break;
      default:
        console.error('host: unknown message', m.t);
    }
  }
  for (const [w, arr] of results) w.postMessage([{ t: 'results', json: JSON.stringify(arr) }]);
}

let inbuf = Buffer.alloc(0);
process.stdin.on('data', (chunk) => {
  inbuf = inbuf.length === 0 ? chunk : Buffer.concat([inbuf, chunk]);
  let off = 0;
  while (inbuf.length - off >= 4) {
    const n = inbuf.readUInt32BE(off);
    if (inbuf.length - off - 4 < n) break;
    onBatch(JSON.parse(inbuf.toString('utf8', off + 4, off + 4 + n)));
    off += 4 + n;
  }
  inbuf = off === inbuf.length ? Buffer.alloc(0) : inbuf.subarray(off);
});
process.stdin.on('end', () => process.exit(0));

send({ t: 'ready', pid: process.pid });
