// The code-mode prelude: the JavaScript API a cell sees (runtime.md §3-§12).
//
// host.js evaluates this file in the cell's own bare V8 isolate (isolated-vm), before any cell
// code, and calls the function it yields with seven host callbacks. The callbacks copy their
// primitive arguments to the host and return nothing, so no object of the host ever exists in
// here; the function returns `entry`, the host's only way in (configure, run, deliver results,
// fire timers). Everything this file relies on is captured before cell code runs, and every
// argument a cell passes is read once, so overriding built-ins or passing getters and proxies can
// only change what that cell itself sees.
(function installPrelude(hostItem, hostCall, hostNotify, hostYield, hostFinish, hostSetTimer,
  hostClearTimer) {
  'use strict';

  const g = globalThis;
  // Captured before cell code runs, so a cell that overwrites globals cannot break the helpers.
  const stringify = JSON.stringify;
  const parse = JSON.parse;
  const StringOf = String;
  const NumberOf = Number;
  const isArray = Array.isArray;
  const isFiniteNumber = Number.isFinite;
  const trunc = Math.trunc;
  const PromiseCtor = Promise;
  const MapCtor = Map;
  const defineProperty = Object.defineProperty;
  const toLower = (s) => StringOf.prototype.toLowerCase.call(s);
  const trim = (s) => StringOf.prototype.trim.call(s);
  const reTest = (re, s) => RegExp.prototype.test.call(re, s);
  const apply = Reflect.apply;
  const uncurry = Function.prototype.bind.bind(Function.prototype.call);
  const mapGet = uncurry(MapCtor.prototype.get);
  const mapSet = uncurry(MapCtor.prototype.set);
  const mapDelete = uncurry(MapCtor.prototype.delete);
  const mapEntries = uncurry(MapCtor.prototype.entries);
  const iteratorNext = uncurry(Object.getPrototypeOf(new MapCtor().entries()).next);
  const charCodeAt = uncurry(StringOf.prototype.charCodeAt);
  const codePointAt = uncurry(StringOf.prototype.codePointAt);
  const toWellFormed = uncurry(StringOf.prototype.toWellFormed);
  const promiseThen = uncurry(PromiseCtor.prototype.then);
  const ErrorCtor = Error;
  const reExec = (re, s) => RegExp.prototype.exec.call(re, s);

  for (const name of ['console', 'Atomics', 'SharedArrayBuffer', 'WebAssembly']) {
    delete g[name];
  }

  // Limits on what one cell sends out (characters, i.e. UTF-16 code units): its output items and
  // notifications together, and the JSON text of one tool input. Above the carriers' own frame
  // limits, so that those still answer with their own errors; below what would hurt the host.
  const MAX_OUTPUT_CHARS = 64 * 1024 * 1024;
  const MAX_TOOL_INPUT_CHARS = 128 * 1024 * 1024;
  // Every item also costs this much, so that a flood of empty items is bounded too.
  const ITEM_OVERHEAD_CHARS = 64;
  const MAX_STORE_CHARS = 64 * 1024 * 1024; // keys and values a cell writes with store()
  const MAX_PENDING_CALLS = 4096; // unsettled tool calls of one cell
  let storeChars = 0;
  let outputChars = 0;

  function within(list, value) {
    for (let i = 0; i < list.length; i++) if (list[i] === value) return true;
    return false;
  }

  // -- thrown values -> error text (§12) ---------------------------------------------------------
  // Frames of the host's own files say nothing to a model; the cell's frames (exec_main.mjs) stay.
  // The prelude's own frames, and the frame of the captured JSON.stringify it calls.
  const HOST_FRAME = /^\s+at (.*codemode-prelude\.js|stringify \(<anonymous>\)$)/;
  function cleanStack(stack) {
    const lines = StringOf.prototype.split.call(stack, '\n');
    const kept = [];
    for (const line of lines) {
      if (!reTest(HOST_FRAME, line)) kept.push(line);
    }
    return kept.join('\n');
  }
  function errorText(value) {
    try {
      if (value !== null && (typeof value === 'object' || typeof value === 'function')) {
        const stack = value.stack;
        if (typeof stack === 'string') return cleanStack(stack);
      }
      return StringOf(value);
    } catch (error) {
      return 'uncaught exception';
    }
  }

  // -- value to text (§5.1) ----------------------------------------------------------------------
  function valueToText(value) {
    const type = typeof value;
    if (value === undefined || value === null || type === 'boolean' || type === 'number' ||
        type === 'bigint' || type === 'string') {
      return StringOf(value);
    }
    let text;
    try {
      text = stringify(value);
    } catch (error) {
      throw errorText(error);
    }
    return text === undefined ? 'undefined' : text; // functions, symbols (checked upstream)
  }

  // -- cell state --------------------------------------------------------------------------------
  let finished = false;
  const stored = new MapCtor(); // key -> JSON text (snapshot + own writes)
  const written = new MapCtor(); // key -> JSON text (own writes, committed on completion)
  const pendingCalls = new MapCtor(); // runtime tool call id -> [resolve, reject, site, tool index]
  const timers = new MapCtor(); // timer id -> callback
  let nextCall = 1;
  let nextTimer = 1;
  const MAX_TIMERS = 10000;
  const MAX_NOTIFICATIONS = 10000;
  let notifyBudget = MAX_NOTIFICATIONS;

  // Counts a text against the cell's output limits before it leaves.
  function charge(text) {
    const size = text.length + ITEM_OVERHEAD_CHARS;
    if (outputChars + size > MAX_OUTPUT_CHARS) {
      throw 'exec cell output exceeds the limit of ' + MAX_OUTPUT_CHARS + ' characters';
    }
    outputChars += size;
  }

  // Items cross as primitives: (type, text or URL, detail).
  function emit(type, value, detail) {
    if (finished) return;
    charge(value);
    hostItem(type, toWellFormed(value), detail);
  }

  function writesJson() {
    let out = '[';
    const entries = mapEntries(written);
    for (let step = iteratorNext(entries); !step.done; step = iteratorNext(entries)) {
      if (out.length > 1) out += ',';
      out += '[' + stringify(toWellFormed(step.value[0])) + ',' + toWellFormed(step.value[1]) + ']';
    }
    return out + ']';
  }

  // Ends the cell now as a natural completion; nothing of the cell runs afterwards.
  function finish(errorTextOrNull, site) {
    if (finished) return;
    finished = true;
    let writes;
    try {
      writes = writesJson();
    } catch (error) {
      writes = '[]';
    }
    const text = errorTextOrNull === null ? null : toWellFormed(StringOf(errorTextOrNull));
    if (site === null || site === undefined) hostFinish(text, writes);
    else hostFinish(text, writes, site[0], site[1], site[2]);
  }

  // -- where a failed tool call was made ---------------------------------------------------------
  // A tool failure rejects with a plain string (§4.2), which carries no position. So each call
  // keeps an Error made where the cell called the tool (its stack is formatted only if the call
  // fails), and a cell that ends with exactly the text of a failed call reports that call's site
  // beside its error text. Keyed by text: a string has no identity to key by.
  const FAILURES_KEPT = 64;
  const CELL_POSITION = /exec_main\.mjs:(\d+):(\d+)/;
  let failures = null; // error text -> [tool index, site Error], the latest failure last

  function recordFailure(text, pending) {
    if (failures === null) failures = new MapCtor();
    mapDelete(failures, text);
    if (failures.size >= FAILURES_KEPT) mapDelete(failures, iteratorNext(mapEntries(failures)).value[0]);
    mapSet(failures, text, [pending[3], pending[2]]);
  }

  // [tool index, line, column] of the failed call whose text `error` is, or null.
  function failedCallSite(error) {
    if (typeof error !== 'string' || failures === null) return null;
    const failure = mapGet(failures, error);
    if (failure === undefined) return null;
    try {
      const stack = failure[1].stack; // may run the cell's own Error.prepareStackTrace
      if (typeof stack !== 'string') return null;
      const match = reExec(CELL_POSITION, stack);
      return match === null ? null : [failure[0], NumberOf(match[1]), NumberOf(match[2])];
    } catch (ignored) {
      return null;
    }
  }

  function fail(error) {
    if (error === EXIT) return;
    const site = failedCallSite(error);
    finish(errorText(error), site);
  }

  // -- output helpers (§5) -----------------------------------------------------------------------
  const IMAGE_ANY =
    'image expects a non-empty image URL string, an object with image_url and optional detail, ' +
    'or a raw MCP image block';
  const AUDIO_ANY =
    'audio expects a non-empty audio URL string, an object with audio_url, or a raw MCP audio block';
  const DETAILS = ['auto', 'low', 'high', 'original'];
  const DATA_PREFIX = /^data:/i;

  function isPlainObject(value) {
    return value !== null && typeof value === 'object' && !isArray(value);
  }

  function mcpDataUrl(block, missingData) {
    const data = block.data;
    if (typeof data !== 'string' || data === '') throw missingData;
    if (reTest(DATA_PREFIX, data)) return data;
    let mime = block.mimeType;
    if (typeof mime !== 'string' || mime === '') mime = block.mime_type;
    if (typeof mime !== 'string' || mime === '') mime = 'application/octet-stream';
    return 'data:' + mime + ';base64,' + data;
  }

  function schemeOf(url) {
    const colon = StringOf.prototype.indexOf.call(url, ':');
    return colon < 0 ? null : toLower(StringOf.prototype.slice.call(url, 0, colon));
  }

  function checkDetail(detail) {
    if (detail === undefined || detail === null) return undefined;
    if (typeof detail !== 'string') throw 'image detail must be a string when provided';
    const lowered = toLower(detail);
    if (!within(DETAILS, lowered)) throw 'image detail must be one of: auto, low, high, original';
    return lowered;
  }

  function imageItem(value, detailArgument) {
    let url;
    let embedded;
    let metaDetail;
    if (typeof value === 'string') {
      url = value;
    } else if (isPlainObject(value) && value.image_url !== undefined) {
      if (typeof value.image_url !== 'string') throw IMAGE_ANY;
      url = value.image_url;
      embedded = value.detail;
    } else if (isPlainObject(value) && typeof value.type === 'string') {
      if (value.type !== 'image') throw 'image only accepts MCP image blocks, got "' + value.type + '"';
      url = mcpDataUrl(value, 'image expected MCP image data');
      const meta = value._meta;
      const hinted = isPlainObject(meta) ? meta['codex/imageDetail'] : undefined;
      if (typeof hinted === 'string' && within(DETAILS, hinted)) metaDetail = hinted;
    } else {
      throw IMAGE_ANY;
    }
    if (url === '') throw IMAGE_ANY;
    const scheme = schemeOf(url);
    if (scheme === 'http' || scheme === 'https') {
      throw 'Tool call failed: remote image URLs are not supported in tool outputs. Pass a base64 data URI instead';
    }
    if (scheme !== 'data') throw 'Tool call failed: invalid image output. Pass a base64 data URI instead';
    const fromObject = checkDetail(embedded);
    const fromArgument = checkDetail(detailArgument);
    const detail = fromArgument !== undefined ? fromArgument : (fromObject !== undefined ? fromObject : metaDetail);
    return [url, detail === undefined ? 'high' : detail];
  }

  function image(value, detail) {
    const [url, resolved] = imageItem(value, detail);
    emit('input_image', url, resolved);
  }

  function generatedImage(result) {
    if (!isPlainObject(result)) throw 'generatedImage expects an image generation result object';
    const hint = result.output_hint;
    if (hint !== undefined && typeof hint !== 'string') {
      throw 'generatedImage output_hint must be a string when provided';
    }
    const [url, detail] = imageItem(result, undefined);
    emit('input_image', url, detail);
    if (hint !== undefined) emit('input_text', hint);
  }

  const SHORT_AUDIO = 'Audio output omitted because the clip is shorter than 25 ms; use a longer clip.';
  const BASE64_DATA_URL = /^data:[^,]*;base64,/i;

  function audio(value) {
    let url;
    if (typeof value === 'string') {
      url = value;
    } else if (isPlainObject(value) && value.audio_url !== undefined) {
      if (typeof value.audio_url !== 'string') throw AUDIO_ANY;
      url = value.audio_url;
    } else if (isPlainObject(value) && typeof value.type === 'string') {
      if (value.type !== 'audio') throw 'audio only accepts MCP audio blocks, got "' + value.type + '"';
      url = mcpDataUrl(value, 'audio expected MCP audio data');
    } else {
      throw AUDIO_ANY;
    }
    if (url === '') throw AUDIO_ANY;
    if (schemeOf(url) !== 'data') {
      throw 'Tool call failed: invalid audio output. Pass a base64 data URI instead';
    }
    const match = BASE64_DATA_URL.exec(url);
    if (match !== null && isShortWav(url, match[0].length)) {
      emit('input_text', SHORT_AUDIO);
    } else {
      emit('input_audio', url);
    }
  }

  // WAV clip shorter than 25 ms? (runtime.md §5.5) Reads the base64 text in place (a byte at a
  // time, only where the RIFF chunk headers are); not measurable -> false (keep the audio).
  function sextet(code) {
    if (code >= 65 && code <= 90) return code - 65;
    if (code >= 97 && code <= 122) return code - 71;
    if (code >= 48 && code <= 57) return code + 4;
    if (code === 43 || code === 45) return 62;
    if (code === 47 || code === 95) return 63;
    return -1;
  }
  function isShortWav(url, start) {
    let end = url.length;
    while (end > start && charCodeAt(url, end - 1) === 61) end--; // '=' padding
    const total = Math.floor(((end - start) * 3) / 4);
    const byteAt = (index) => {
      const group = start + Math.floor(index / 3) * 4;
      let bits = 0;
      for (let k = 0; k < 4; k++) {
        const at = group + k;
        const value = at < end ? sextet(charCodeAt(url, at)) : 0;
        if (value < 0) throw 0;
        bits = bits * 64 + value;
      }
      return Math.floor(bits / 2 ** (8 * (2 - (index % 3)))) % 256;
    };
    const u32 = (i) => byteAt(i) + byteAt(i + 1) * 256 + byteAt(i + 2) * 65536 + byteAt(i + 3) * 16777216;
    const u16 = (i) => byteAt(i) + byteAt(i + 1) * 256;
    const tag = (i) => StringOf.fromCharCode(byteAt(i), byteAt(i + 1), byteAt(i + 2), byteAt(i + 3));
    try {
      if (total < 12 || tag(0) !== 'RIFF' || tag(8) !== 'WAVE') return false;
      let offset = 12;
      let rate = 0;
      let align = 0;
      let usable = -1;
      while (offset + 8 <= total) {
        const id = tag(offset);
        const size = u32(offset + 4);
        const body = offset + 8;
        if (id === 'fmt ' && body + 14 <= total) {
          rate = u32(body + 4);
          align = u16(body + 12);
        } else if (id === 'data') {
          usable = Math.min(size, total - body);
        }
        offset = body + size + (size % 2);
      }
      if (usable < 0 || rate === 0 || align === 0) return false;
      return Math.floor(usable / align) * 40 < rate;
    } catch (error) {
      return false;
    }
  }

  function text(value) {
    emit('input_text', valueToText(value));
  }

  // Opt-in (config.console): console.log(...values) and its siblings append one text item, the
  // values stringified like text() and joined by spaces. Upstream cells have no console.
  function makeConsole() {
    const write = (...values) => {
      let line = '';
      for (let i = 0; i < values.length; i++) line += (i === 0 ? '' : ' ') + valueToText(values[i]);
      emit('input_text', line);
    };
    return { log: write, info: write, warn: write, error: write, debug: write };
  }

  // -- store / load (§6) -------------------------------------------------------------------------
  const RESERVED_KEYS = ['$serde_json::private::RawValue', '$serde_json::private::Number'];
  const RESERVED = {};

  function debugQuote(key) {
    let out = '"';
    for (let i = 0; i < key.length; i++) {
      const code = codePointAt(key, i);
      const ch = StringOf.fromCodePoint(code);
      if (code > 0xffff) i++;
      if (ch === '"') out += '\\"';
      else if (ch === '\\') out += '\\\\';
      else if (ch === '\t') out += '\\t';
      else if (ch === '\r') out += '\\r';
      else if (ch === '\n') out += '\\n';
      else if (ch === '\0') out += '\\0';
      else if (code < 0x20 || (code >= 0x7f && code <= 0x9f)) out += '\\u{' + code.toString(16) + '}';
      else out += ch;
    }
    return out + '"';
  }

  function rejectReserved(key, value) {
    if (within(RESERVED_KEYS, key) && this !== null && typeof this === 'object' && !isArray(this)) {
      throw RESERVED;
    }
    return value;
  }

  function store(key, value) {
    const name = `${key}`;
    let serialized;
    try {
      serialized = stringify(value, rejectReserved);
    } catch (error) {
      if (error === RESERVED) throw 'failed to serialize JavaScript value: reserved JSON object key';
      throw errorText(error);
    }
    if (serialized === undefined) {
      if (typeof value === 'function' || typeof value === 'symbol') {
        throw 'failed to serialize JavaScript value: expected value at line 1 column 1';
      }
      throw 'Unable to store ' + debugQuote(name) + '. Only plain serializable objects can be stored.';
    }
    if (finished) return;
    const previous = mapGet(written, name);
    const grown = storeChars + name.length + serialized.length -
      (previous === undefined ? 0 : name.length + previous.length);
    if (grown > MAX_STORE_CHARS) {
      throw 'store exceeds the limit of ' + MAX_STORE_CHARS + ' characters written per cell';
    }
    storeChars = grown;
    mapSet(stored, name, serialized);
    mapSet(written, name, serialized);
  }

  function load(key) {
    const serialized = mapGet(stored, `${key}`);
    return serialized === undefined ? undefined : parse(serialized);
  }

  // -- notify / yield / exit (§7-§9) --------------------------------------------------------------
  function notify(value) {
    const message = valueToText(value);
    if (trim(message) === '') throw 'notify expects non-empty text';
    if (finished) return;
    if (notifyBudget <= 0) throw 'notify exceeded the limit of ' + MAX_NOTIFICATIONS + ' notifications per cell';
    notifyBudget--;
    charge(message);
    hostNotify(toWellFormed(message));
  }

  // A second yield in the same turn changes nothing (decision 0004): it is not sent.
  let yieldedTurn = -1;
  function yield_control() {
    if (finished || yieldedTurn === turn) return;
    yieldedTurn = turn;
    hostYield(turn);
  }

  // Nothing of the cell is observable after exit(): the host disposes the isolate on `finish`, and
  // until then every helper is a no-op. The throw unwinds whatever the cell was doing.
  const EXIT = {};
  function exit() {
    finish(null);
    throw EXIT;
  }

  // -- timers (§10) ------------------------------------------------------------------------------
  function setTimeout(callback, delay) {
    if (typeof callback !== 'function') throw 'setTimeout expects a function callback';
    let ms = NumberOf(delay);
    ms = !isFiniteNumber(ms) || ms <= 0 ? 0 : trunc(ms);
    const id = nextTimer++;
    if (finished) return id;
    if (timers.size >= MAX_TIMERS) throw 'setTimeout exceeded the limit of ' + MAX_TIMERS + ' pending timers';
    mapSet(timers, id, callback);
    hostSetTimer(id, ms);
    return id;
  }

  function clearTimeout(id) {
    if (typeof id === 'symbol' || typeof id === 'bigint') {
      throw 'clearTimeout expects a numeric timeout id';
    }
    if (id === undefined || id === null) return;
    const number = NumberOf(id);
    if (number !== number || !isFiniteNumber(number) || number <= 0) return;
    const key = trunc(number);
    if (mapDelete(timers, key)) hostClearTimer(key);
  }

  // -- tools (§4) --------------------------------------------------------------------------------
  function makeTool(index) {
    return function (...args) {
      // JSON round trip of the argument; a throw here happens before any promise exists.
      const argument = args[0];
      if (typeof argument === 'function' || typeof argument === 'symbol') {
        // What the upstream host does (both releases checked), against runtime.md §4.3's text.
        throw 'failed to serialize JavaScript value: expected value at line 1 column 1';
      }
      const input = args.length === 0 ? undefined : stringify(argument);
      if (input !== undefined && input.length > MAX_TOOL_INPUT_CHARS) {
        throw 'tool input of ' + input.length + ' characters exceeds the limit of ' + MAX_TOOL_INPUT_CHARS + ' characters';
      }
      if (pendingCalls.size >= MAX_PENDING_CALLS) {
        // Refused like any call over a limit (a rejection), without a word to the host.
        return PromiseCtor.reject('too many pending tool calls in this cell (limit ' + MAX_PENDING_CALLS + ')');
      }
      const id = 'tool-' + nextCall++;
      const site = new ErrorCtor();
      return new PromiseCtor((resolve, reject) => {
        if (finished) return;
        mapSet(pendingCalls, id, [resolve, reject, site, index]);
        hostCall(id, index, input === undefined ? null : toWellFormed(input));
      });
    };
  }

  function install(name, value) {
    defineProperty(g, name, { value, writable: true, configurable: true, enumerable: true });
  }

  // -- the host's way in ---------------------------------------------------------------------------
  // `turn` counts the host's entries into the isolate: two yield_control() calls in one
  // uninterrupted run of the cell share a turn (decision 0004).
  let turn = 0;

  function configure(configJson) {
    const config = parse(configJson);
    const tools = {};
    for (const [identifier, index] of config.tools) {
      tools[identifier] = makeTool(index); // the last tool with an identifier wins
    }
    // Enumerable, in the upstream host's order (what `Object.keys(globalThis)` shows).
    install('tools', tools);
    install('ALL_TOOLS', config.all);
    install('clearTimeout', clearTimeout);
    install('setTimeout', setTimeout);
    install('text', text);
    install('image', image);
    install('audio', audio);
    install('generatedImage', generatedImage);
    if (config.store !== null) {
      for (const [key, serialized] of config.store) mapSet(stored, key, serialized);
      install('store', store);
      install('load', load);
    }
    install('notify', notify);
    install('yield_control', yield_control);
    install('exit', exit);
    if (config.console) install('console', makeConsole());
  }

  // Every dynamic import() of the cell is renamed to a call of this (host.js).
  const dynamicImport = () => PromiseCtor.reject('unsupported import in exec');

  // `wrapper` takes the dynamic-import function and returns the cell as an async function.
  // Cell code (the cell's body, a timer callback) is called from a microtask, so that no frame of
  // this file sits under it: its stack traces show only the cell's own frames.
  const resolved = PromiseCtor.resolve();

  function run(wrapper) {
    let cell;
    try {
      cell = apply(wrapper, undefined, [dynamicImport]);
    } catch (error) {
      finish(errorText(error));
      return;
    }
    promiseThen(promiseThen(resolved, cell), () => finish(null), fail);
  }

  // resultsJson: [[runtime tool call id, ok, value or error text], ...]
  function deliver(resultsJson) {
    if (finished) return;
    const results = parse(resultsJson);
    for (let i = 0; i < results.length; i++) {
      const [id, ok, value] = results[i];
      const pending = mapGet(pendingCalls, id);
      if (pending === undefined) continue;
      mapDelete(pendingCalls, id);
      if (ok) {
        pending[0](value);
      } else {
        const text = StringOf(value);
        recordFailure(text, pending);
        pending[1](text);
      }
    }
  }

  function fireTimer(id) {
    const callback = mapGet(timers, id);
    if (callback === undefined || finished) return;
    mapDelete(timers, id);
    // Only what the callback throws ends the cell; a promise it returns is not awaited (§2.5).
    const call = () => {
      apply(callback, undefined, []);
    };
    promiseThen(promiseThen(resolved, call), undefined, fail);
  }

  return function entry(kind, a) {
    if (kind === 'configure') configure(a);
    else if (kind === 'run') run(a);
    else if (kind === 'fail') finish(a);
    else if (kind === 'deliver') {
      turn += 1;
      deliver(a);
    } else if (kind === 'timer') {
      turn += 1;
      fireTimer(a);
    }
  };
});
