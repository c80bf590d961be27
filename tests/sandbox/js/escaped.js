'use strict';
// TEST-ONLY. Stands for an attacker who has escaped the JavaScript sandbox and runs with the whole
// Node API inside the engine process. It tries, one by one, to use powers the engine process must
// not have and prints ONE JSON line: {attempt: "ok" | error code}. "ok" means the power was
// there. Nothing here may throw past `attempt`: the test reads every outcome.
//
// argv[2] is a JSON object from tests/sandbox/test_confinement.py:
//   tmp, allowed: directories to write into; secret: a file to read; marker: the file a spawned
//   shell would create; port / udpPort: loopback TCP and UDP listeners; unixPath / abstractName:
//   UNIX listeners; victim: the pid of another process of the same user (a sibling engine, say).

const fs = require('fs');
const path = require('path');
const net = require('net');
const dgram = require('dgram');
const os = require('os');

const config = JSON.parse(process.argv[2]);
const outcomes = {};

function describe(error) {
  if (error && typeof error === 'object') return String(error.code || error.name || error.message);
  return String(error);
}

function attempt(name, action) {
  try {
    const result = action();
    outcomes[name] = result === undefined ? 'ok' : result;
  } catch (error) {
    outcomes[name] = describe(error);
  }
}

// Settles with "ok" or an error code; a hung attempt counts as "timeout" (it did not happen).
function attemptAsync(name, action, ms = 2000) {
  return new Promise((resolve) => {
    let settled = false;
    const settle = (value) => {
      if (!settled) {
        settled = true;
        outcomes[name] = value;
        resolve();
      }
    };
    const timer = setTimeout(() => settle('timeout'), ms);
    try {
      action(
        () => { clearTimeout(timer); settle('ok'); },
        (error) => { clearTimeout(timer); settle(describe(error)); },
      );
    } catch (error) {
      clearTimeout(timer);
      settle(describe(error));
    }
  });
}

function spawnOutcome(result) {
  if (result.error) return typeof result.error === 'number' ? `errno ${result.error}` : describe(result.error);
  if (result.status !== 0) return `exit ${result.status} signal ${result.signal}`;
  return 'ok';
}

function connect(options, ok, fail) {
  const socket = net.connect(options);
  socket.on('connect', () => { socket.destroy(); ok(); });
  socket.on('error', fail);
}

async function main() {
  // --- files ---
  attempt('write_tmp', () => fs.writeFileSync(path.join(config.tmp, 'escaped-tmp.txt'), 'x'));
  attempt('write_allowed', () => fs.writeFileSync(path.join(config.allowed, 'escaped-allowed.txt'), 'x'));
  attempt('write_cwd', () => fs.writeFileSync('escaped-cwd.txt', 'x'));
  // Opened for writing, not written: this very file is in the read-only set.
  attempt('open_read_path_for_write', () => { fs.closeSync(fs.openSync(__filename, 'r+')); });
  attempt('read_secret', () => (fs.readFileSync(config.secret, 'utf8').includes('secret') ? 'ok' : 'read-but-empty'));
  attempt('read_parent_environ', () => { fs.readFileSync(`/proc/${process.ppid}/environ`); });
  attempt('proc_self_mem_write', () => { fs.closeSync(fs.openSync('/proc/self/mem', 'r+')); });
  // Metadata, which Landlock does not govern: a file that may not be written keeps its mode and times.
  attempt('chmod_secret', () => fs.chmodSync(config.secret, 0o666));
  attempt('utimes_secret', () => fs.utimesSync(config.secret, 2, 2));

  // --- processes ---
  const shell = `echo pwned > '${config.marker}'; echo pwned`;
  attempt('spawn_sync', () => {
    const result = require('child_process').spawnSync('/bin/sh', ['-c', shell], { timeout: 2000 });
    return spawnOutcome(result);
  });
  attempt('exec_file_sync', () => {
    require('child_process').execFileSync('/bin/sh', ['-c', shell], { timeout: 2000 });
  });
  // Below the JavaScript API and its permission checks: the C++ binding libuv spawns with.
  attempt('raw_spawn', () => {
    const result = process.binding('spawn_sync').spawn({
      file: '/bin/sh',
      args: ['/bin/sh', '-c', shell],
      envPairs: [],
      stdio: [{ type: 'ignore' }, { type: 'ignore' }, { type: 'ignore' }],
    });
    return spawnOutcome(result);
  });
  attempt('kill_parent', () => { process.kill(process.ppid, 'SIGUSR2'); });
  // setpriority(2) on another process of the same user; Landlock's signal scope does not cover it.
  attempt('renice_other', () => { os.setPriority(config.victim, 19); });
  await attemptAsync('worker', (ok, fail) => {
    const { Worker } = require('worker_threads');
    const worker = new Worker('require("worker_threads").parentPort.postMessage(1)', { eval: true });
    worker.on('message', () => { worker.terminate(); ok(); });
    worker.on('error', fail);
  });

  // --- network ---
  await attemptAsync('tcp_connect', (ok, fail) => connect({ host: '127.0.0.1', port: config.port }, ok, fail));
  await attemptAsync('tcp_socket', (ok, fail) => {
    const socket = new net.Socket();
    socket.on('error', fail);
    socket.connect(config.port, '127.0.0.1', () => { socket.destroy(); ok(); });
  });
  await attemptAsync('tcp_bind', (ok, fail) => {
    const server = net.createServer();
    server.on('error', fail);
    server.listen(0, '127.0.0.1', () => server.close(ok));
  });
  await attemptAsync('udp_send', (ok, fail) => {
    const socket = dgram.createSocket('udp4');
    socket.on('error', fail);
    socket.send('x', config.udpPort, '127.0.0.1', (error) => {
      socket.close();
      if (error) fail(error); else ok();
    });
  });
  await attemptAsync('abstract_unix_connect', (ok, fail) => connect({ path: `\0${config.abstractName}` }, ok, fail));
  await attemptAsync('unix_connect', (ok, fail) => connect({ path: config.unixPath }, ok, fail));

  process.stdout.write(`${JSON.stringify(outcomes)}\n`);
}

main().catch((error) => {
  process.stdout.write(`${JSON.stringify({ crashed: describe(error) })}\n`);
});
