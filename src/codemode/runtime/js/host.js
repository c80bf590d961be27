'use strict';
// The code-mode engine host: one Node process that runs cells for a Python runtime.
//
// Started as `node --experimental-vm-modules --disable-warning=ExperimentalWarning host.js`.
// Each cell runs in its own worker_threads Worker (its own V8 isolate, its own heap limit,
// terminable while it spins), evaluated as an ES module in a fresh vm context (worker.js).
// Warm workers are spawned ahead of time so that an execute does not pay isolate start-up.
//
// Python <-> host, over this process's stdin/stdout: a frame is a 4-byte little-endian length
// and a UTF-8 JSON array of messages (a batch). Each side writes everything it queued in one
// turn as one frame. stdout carries frames only; diagnostics go to stderr.
//
// Python -> host
//   {t:'pool', heap:int|null, size:int}           keep `size` warm workers for heap limit `heap` (MB)
//   {t:'exec', cell:int, heap:int|null, source:str, config:str}
//                                                 run a cell; `config` is the prelude's JSON text
//   {t:'results', cell, r:[[call_id, ok, value]]} settle nested tool calls (ok=false: error text)
//   {t:'terminate', cell}                         stop the cell's isolate (works while it spins)
//
// Host -> Python
//   {t:'ready'}                                   the host is up
//   {t:'started', cell}                           module linked, evaluation begins
//   {t:'item', cell, type, value, detail}         a content item (text or URL, image detail)
//   {t:'call', cell, id, tool:int, input:str|null}
//                                                 nested tool call; input is JSON text or null
//   {t:'notify', cell, text}                      notify(text)
//   {t:'yield', cell, turn:int}                   yield_control() in the cell's event-loop turn
//   {t:'done', cell, error:str|null, writes:str}  completed; writes = JSON [[key, json text]]
//   {t:'exited', cell, reason:'stopped'|'oom'|'crashed', detail?}
//                                                 the cell's isolate is gone (always sent, last)

const { Worker } = require('node:worker_threads');
const path = require('node:path');

for (const name of ['log', 'info', 'debug', 'warn']) console[name] = console.error;

const WORKER_FILE = path.join(__dirname, 'worker.js');
const REFILL_DELAY_MS = 10;

// -- outbound: one frame per turn ----------------------------------------------------------------
let outbox = [];
let flushQueued = false;

function flush() {
  flushQueued = false;
  const body = Buffer.from(JSON.stringify(outbox), 'utf8');
  outbox = [];
  const head = Buffer.allocUnsafe(4);
  head.writeUInt32LE(body.length, 0);
  process.stdout.write(Buffer.concat([head, body]));
}

function send(message) {
  outbox.push(message);
  if (!flushQueued) {
    flushQueued = true;
    setImmediate(flush);
  }
}

// -- workers -------------------------------------------------------------------------------------
const warm = new Map(); // heap key -> warm idle workers
const poolSize = new Map(); // heap key -> wanted number of warm workers
const booting = new Map(); // heap key -> workers starting for the pool
const cells = new Map(); // cell -> worker

function keyOf(heap) {
  return heap === null || heap === undefined ? 'none' : String(heap);
}

function spawn(heap) {
  const options = { stdout: true, stderr: false };
  if (heap !== null && heap !== undefined) {
    options.resourceLimits = {
      maxOldGenerationSizeMb: heap,
      maxYoungGenerationSizeMb: Math.max(1, Math.min(16, Math.floor(heap / 4))),
    };
  }
  const worker = new Worker(WORKER_FILE, options);
  worker.stdout.pipe(process.stderr);
  worker.heap = heap;
  worker.cell = null;
  worker.isWarm = false;
  worker.pending = null;
  worker.finished = false;
  worker.stopping = false;
  worker.oom = false;
  worker.failure = null;
  worker.on('message', (batch) => fromWorker(worker, batch));
  worker.on('error', (error) => {
    if (error && error.code === 'ERR_WORKER_OUT_OF_MEMORY') worker.oom = true;
    worker.failure = String((error && error.stack) || error);
  });
  worker.on('exit', () => exited(worker));
  return worker;
}

function refill(heap) {
  const key = keyOf(heap);
  const want = poolSize.get(key) || 0;
  const ready = (warm.get(key) || []).length;
  let starting = booting.get(key) || 0;
  while (ready + starting < want) {
    spawn(heap);
    starting += 1;
  }
  booting.set(key, starting);
}

function fromWorker(worker, batch) {
  for (const message of batch) {
    if (message.t === 'warm') {
      worker.isWarm = true;
      if (worker.pending !== null) {
        const exec = worker.pending;
        worker.pending = null;
        worker.postMessage([exec]);
      } else {
        const key = keyOf(worker.heap);
        booting.set(key, Math.max(0, (booting.get(key) || 0) - 1));
        if (!warm.has(key)) warm.set(key, []);
        warm.get(key).push(worker);
      }
      continue;
    }
    if (message.t === 'done') worker.finished = true;
    send(message);
  }
}

function exited(worker) {
  const key = keyOf(worker.heap);
  const idle = warm.get(key);
  if (idle) {
    const index = idle.indexOf(worker);
    if (index >= 0) idle.splice(index, 1);
  }
  if (worker.cell === null) {
    // A pool worker died before it was used: do not respawn in a loop.
    if (!worker.isWarm) booting.set(key, Math.max(0, (booting.get(key) || 0) - 1));
    return;
  }
  const cell = worker.cell;
  cells.delete(cell);
  let reason = 'stopped';
  if (!worker.finished && !worker.stopping) reason = worker.oom ? 'oom' : 'crashed';
  const message = { t: 'exited', cell, reason };
  if (reason === 'crashed') message.detail = worker.failure || 'worker exited';
  send(message);
  refill(worker.heap);
}

function exec(message) {
  const key = keyOf(message.heap);
  const idle = warm.get(key) || [];
  const run = { t: 'exec', cell: message.cell, source: message.source, config: message.config };
  let worker = idle.shift();
  if (worker === undefined) {
    worker = spawn(message.heap);
    worker.pending = run;
  } else {
    worker.postMessage([run]);
  }
  worker.cell = message.cell;
  cells.set(message.cell, worker);
  // Give the cell a head start: a worker boot is ~30 ms of CPU and, on a small machine, slows the
  // cell's first milliseconds (and the forwarding of its output) when it starts at once.
  setTimeout(() => refill(message.heap), REFILL_DELAY_MS);
}

// -- inbound -------------------------------------------------------------------------------------
function onBatch(batch) {
  const results = new Map(); // worker -> [[call, ok, value]]
  for (const message of batch) {
    switch (message.t) {
      case 'results': {
        const worker = cells.get(message.cell);
        if (worker === undefined || worker.stopping) break; // late: the cell is gone
        let list = results.get(worker);
        if (list === undefined) results.set(worker, (list = []));
        for (const entry of message.r) list.push(entry);
        break;
      }
      case 'exec':
        exec(message);
        break;
      case 'terminate': {
        const worker = cells.get(message.cell);
        if (worker === undefined) {
          send({ t: 'exited', cell: message.cell, reason: 'stopped' });
        } else if (!worker.stopping) {
          worker.stopping = true;
          worker.terminate();
        }
        break;
      }
      case 'pool':
        poolSize.set(keyOf(message.heap), message.size);
        refill(message.heap);
        break;
      default:
        console.error(`codemode engine host: unknown message ${message.t}`);
    }
  }
  for (const [worker, list] of results) {
    worker.postMessage([{ t: 'results', json: JSON.stringify(list) }]);
  }
}

let buffer = Buffer.alloc(0);
process.stdin.on('data', (chunk) => {
  buffer = buffer.length === 0 ? chunk : Buffer.concat([buffer, chunk]);
  let offset = 0;
  while (buffer.length - offset >= 4) {
    const size = buffer.readUInt32LE(offset);
    if (buffer.length - offset - 4 < size) break;
    onBatch(JSON.parse(buffer.toString('utf8', offset + 4, offset + 4 + size)));
    offset += 4 + size;
  }
  buffer = offset === buffer.length ? Buffer.alloc(0) : buffer.subarray(offset);
});
// The runtime went away: nothing is left to serve.
process.stdin.on('end', () => process.exit(0));

send({ t: 'ready' });
