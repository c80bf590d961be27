// The code-mode prelude: the JavaScript API a cell sees (runtime.md §3-§12).
//
// worker.js evaluates this file inside the cell's fresh vm context and calls the function it
// yields with `host`, a small set of functions from the worker's realm. Only primitives cross
// between the two realms: `host` is captured in this closure and never exposed to cell code, and
// everything the worker hands in (tool results, configuration, the store snapshot) arrives as
// JSON text parsed here, so no outer-realm object (and no outer `Function`) is reachable.
(function installPrelude(host) {
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
  const hasOwn = Object.hasOwn;
  const freeze = Object.freeze;
  const defineProperty = Object.defineProperty;
  const toLower = (s) => StringOf.prototype.toLowerCase.call(s);
  const trim = (s) => StringOf.prototype.trim.call(s);
  const reTest = (re, s) => RegExp.prototype.test.call(re, s);
  const apply = Reflect.apply;

  for (const name of ['console', 'Atomics', 'SharedArrayBuffer', 'WebAssembly']) {
    delete g[name];
  }

  // -- thrown values -> error text (§12) ---------------------------------------------------------
  // Frames of the host's own files say nothing to a model; the cell's frames (exec_main.mjs) stay.
  const HOST_FRAME = /^\s+at .*(node:internal|codemode[\\/]runtime[\\/]js[\\/]|evalmachine\.<anonymous>)/;
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
    return text === undefined ? StringOf(value) : text;
  }

  // -- cell state --------------------------------------------------------------------------------
  let finished = false;
  const stored = new MapCtor(); // key -> JSON text (snapshot + own writes)
  const written = new MapCtor(); // key -> JSON text (own writes, committed on completion)
  const pendingCalls = new MapCtor(); // runtime tool call id -> [resolve, reject]
  const timers = new MapCtor(); // timer id -> callback
  let nextCall = 1;
  let nextTimer = 1;

  // Items cross as primitives: (type, text or URL, detail).
  function emit(type, value, detail) {
    if (!finished) host.item(type, value, detail);
  }

  function writesJson() {
    const pairs = [];
    for (const [key, text] of written) pairs.push([key, text]);
    return stringify(pairs);
  }

  // Ends the cell now as a natural completion; nothing of the cell runs afterwards.
  function finish(errorTextOrNull) {
    if (finished) return;
    finished = true;
    host.finish(errorTextOrNull, writesJson());
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
    if (!DETAILS.includes(lowered)) throw 'image detail must be one of: auto, low, high, original';
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
      if (typeof hinted === 'string' && DETAILS.includes(hinted)) metaDetail = hinted;
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
    if (match !== null && host.isShortWav(StringOf.prototype.slice.call(url, match[0].length))) {
      emit('input_text', SHORT_AUDIO);
    } else {
      emit('input_audio', url);
    }
  }

  function text(value) {
    emit('input_text', valueToText(value));
  }

  // -- store / load (§6) -------------------------------------------------------------------------
  const RESERVED_KEYS = ['$serde_json::private::RawValue', '$serde_json::private::Number'];
  const RESERVED = {};

  function debugQuote(key) {
    let out = '"';
    for (const ch of key) {
      const code = ch.codePointAt(0);
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
    if (RESERVED_KEYS.includes(key) && this !== null && typeof this === 'object' && !isArray(this)) {
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
      throw 'Unable to store ' + debugQuote(name) + '. Only plain serializable objects can be stored.';
    }
    if (finished) return;
    stored.set(name, serialized);
    written.set(name, serialized);
  }

  function load(key) {
    const serialized = stored.get(`${key}`);
    return serialized === undefined ? undefined : parse(serialized);
  }

  // -- notify / yield / exit (§7-§9) --------------------------------------------------------------
  function notify(value) {
    const message = valueToText(value);
    if (trim(message) === '') throw 'notify expects non-empty text';
    if (!finished) host.notify(message);
  }

  function yield_control() {
    if (!finished) host.yieldControl();
  }

  function exit() {
    finish(null);
    host.stop(); // never returns: the cell's thread ends here
  }

  // -- timers (§10) ------------------------------------------------------------------------------
  function setTimeout(callback, delay) {
    if (typeof callback !== 'function') throw 'setTimeout expects a function callback';
    let ms = NumberOf(delay);
    ms = !isFiniteNumber(ms) || ms <= 0 ? 0 : trunc(ms);
    const id = nextTimer++;
    timers.set(id, callback);
    if (!finished) host.setTimer(id, ms);
    return id;
  }

  function clearTimeout(id) {
    if (id === undefined || id === null) return;
    const number = NumberOf(id);
    if (number !== number) throw 'clearTimeout expects a numeric timeout id';
    if (!isFiniteNumber(number) || number <= 0) return;
    const key = trunc(number);
    if (timers.delete(key)) host.clearTimer(key);
  }

  // -- tools (§4) --------------------------------------------------------------------------------
  function makeTool(index) {
    return function (...args) {
      // JSON round trip of the argument; a throw here happens before any promise exists.
      const input = args.length === 0 ? undefined : stringify(args[0]);
      const id = 'tool-' + nextCall++;
      return new PromiseCtor((resolve, reject) => {
        if (finished) return;
        pendingCalls.set(id, [resolve, reject]);
        host.call(id, index, input === undefined ? null : input);
      });
    };
  }

  function install(name, value) {
    defineProperty(g, name, { value, writable: true, configurable: true, enumerable: false });
  }

  // -- the worker's handle on this cell -------------------------------------------------------------
  return freeze({
    // configJson: {"tools": [[identifier, index], ...], "all": [{name, description}], "store": [[key, json], ...] | null}
    configure(configJson) {
      const config = parse(configJson);
      const tools = {};
      for (const [identifier, index] of config.tools) {
        if (!hasOwn(tools, identifier)) tools[identifier] = makeTool(index);
      }
      install('tools', tools);
      install('ALL_TOOLS', config.all);
      install('text', text);
      install('image', image);
      install('generatedImage', generatedImage);
      install('audio', audio);
      install('notify', notify);
      install('yield_control', yield_control);
      install('exit', exit);
      install('setTimeout', setTimeout);
      install('clearTimeout', clearTimeout);
      if (config.store !== null) {
        for (const [key, serialized] of config.store) stored.set(key, serialized);
        install('store', store);
        install('load', load);
      }
    },
    // resultsJson: [[runtime tool call id, ok, value or error text], ...]
    deliver(resultsJson) {
      if (finished) return;
      for (const [id, ok, value] of parse(resultsJson)) {
        const pending = pendingCalls.get(id);
        if (pending === undefined) continue;
        pendingCalls.delete(id);
        if (ok) pending[0](value);
        else pending[1](StringOf(value));
      }
    },
    fireTimer(id) {
      const callback = timers.get(id);
      if (callback === undefined || finished) return;
      timers.delete(id);
      try {
        apply(callback, undefined, []);
      } catch (error) {
        finish(errorText(error));
        host.stop();
      }
    },
    complete(errorTextOrNull) {
      finish(errorTextOrNull);
    },
    errorText,
    compileErrorText(error) {
      try {
        return StringOf(error.name) + ': ' + StringOf(error.message);
      } catch (ignored) {
        return errorText(error);
      }
    },
  });
});
