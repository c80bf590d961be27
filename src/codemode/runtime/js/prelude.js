// The code-mode prelude: the JavaScript API a cell sees (runtime.md §3-§12).
//
// host.js evaluates this file in the cell's own bare V8 isolate (isolated-vm), before any cell
// code, and calls the function it yields with one host callback, whose first argument says what
// is asked (an isolate holds one host handle, not one per kind). The callback copies its
// primitive arguments to the host and returns nothing, so no object of the host ever exists in
// here; the function returns `entry`, the host's only way in (configure, run, deliver results,
// fire timers, read the writes again). Everything this file relies on is captured before cell
// code runs, and every argument a cell passes is read once, so overriding built-ins or passing
// getters and proxies can only change what that cell itself sees.
(function installPrelude(host, wrapColumns) {
  'use strict';

  // Fixed arities: no spread, whose iterator a cell could replace. The numbers are host.js's.
  const hostItem = (type, value, detail) => host(0, type, value, detail);
  const hostCall = (id, tool, input) => host(1, id, tool, input);
  const hostNotify = (text) => host(2, text);
  const hostYield = (turn) => host(3, turn);
  const hostFinish = (error, writes, tool, line, column) =>
    host(4, error, writes, tool, line, column);
  const hostSetTimer = (id, ms) => host(5, id, ms);
  const hostClearTimer = (id) => host(6, id);
  const hostRewritten = () => host(7);
  const hostExit = (writes) => host(8, writes);

  const g = globalThis;
  // Captured before cell code runs, so a cell that overwrites globals cannot break the helpers.
  const stringify = JSON.stringify;
  const parse = JSON.parse;
  const StringOf = String;
  const NumberOf = Number;
  const isArray = Array.isArray;
  const isFiniteNumber = Number.isFinite;
  const trunc = Math.trunc;
  const floor = Math.floor;
  const min = Math.min;
  const fromCharCode = String.fromCharCode;
  const fromCodePoint = String.fromCodePoint;
  const hasOwn = Object.hasOwn;
  const PromiseCtor = Promise;
  const MapCtor = Map;
  const defineProperty = Object.defineProperty;
  // Methods are called through captured functions, never looked up on a prototype the cell can
  // change: RegExp.prototype.test (and every RegExp method) would call the live `exec`.
  const toLower = (s) => lowerCase(s);
  const reTest = (re, s) => regExpExec(re, s) !== null;
  const apply = Reflect.apply;
  const uncurry = Function.prototype.bind.bind(Function.prototype.call);
  const SymbolSpecies = Symbol.species;
  const lowerCase = uncurry(StringOf.prototype.toLowerCase);
  const regExpExec = uncurry(RegExp.prototype.exec);
  const mapSize = uncurry(Object.getOwnPropertyDescriptor(MapCtor.prototype, 'size').get);
  const mapGet = uncurry(MapCtor.prototype.get);
  const mapSet = uncurry(MapCtor.prototype.set);
  const mapDelete = uncurry(MapCtor.prototype.delete);
  const mapEntries = uncurry(MapCtor.prototype.entries);
  const iteratorNext = uncurry(Object.getPrototypeOf(new MapCtor().entries()).next);
  const charCodeAt = uncurry(StringOf.prototype.charCodeAt);
  const promiseThen = uncurry(PromiseCtor.prototype.then);
  const ignore = () => {};
  const codePointAt = uncurry(StringOf.prototype.codePointAt);
  const toWellFormed = uncurry(StringOf.prototype.toWellFormed);
  const ErrorCtor = Error;
  const reExec = (re, s) => regExpExec(re, s);
  const bindFunction = uncurry(Function.prototype.bind);
  const stringSlice = uncurry(StringOf.prototype.slice);
  const stringIndexOf = uncurry(StringOf.prototype.indexOf);
  const numberToString = uncurry(NumberOf.prototype.toString);
  const hex = (code) => numberToString(code, 16);
  const ObjectCtor = Object;
  const NO_ARGUMENTS = ObjectCtor.freeze([]);
  const captureStackTrace = ErrorCtor.captureStackTrace;
  const getOwnPropertyDescriptor = ObjectCtor.getOwnPropertyDescriptor;
  const setPrototypeOf = ObjectCtor.setPrototypeOf;
  const deleteProperty = Reflect.deleteProperty;
  // A promise rejected with `reason`, without Promise.reject (a cell can replace it).
  const rejected = (reason) => new PromiseCtor((resolve, reject) => reject(reason));

  for (const name of ['console', 'Atomics', 'SharedArrayBuffer', 'WebAssembly']) {
    delete g[name];
  }

  // Limits on what one cell sends out (characters, i.e. UTF-16 code units): its output items (not
  // its notifications, whose delivery never affects the cell: runtime.md §7, as upstream), and the
  // JSON text of one tool input. Above the carriers' own frame
  // limits, so that those still answer with their own errors; below what would hurt the host.
  const MAX_OUTPUT_CHARS = 64 * 1024 * 1024;
  const MAX_TOOL_INPUT_CHARS = 128 * 1024 * 1024;
  // Every item also costs this much, so that a flood of empty items is bounded too.
  const ITEM_OVERHEAD_CHARS = 64;
  const MAX_STORE_CHARS = 64 * 1024 * 1024; // keys and values a cell writes with store()
  // Every key written also counts this much: the host pays for a stored entry as such, so that a
  // flood of tiny entries is bounded too (as runtime/session.py counts the session's store).
  const STORE_ENTRY_CHARS = 256;
  const MAX_PENDING_CALLS = 4096; // unsettled tool calls of one cell
  let storeChars = 0;
  let outputChars = 0;

  function within(list, value) {
    for (let i = 0; i < list.length; i++) if (list[i] === value) return true;
    return false;
  }

  // -- thrown values -> error text (§12) ---------------------------------------------------------
  // Frames of the host's own files say nothing to a model; the cell's frames (exec_main.mjs) stay.
  // The prelude's own frames, and the frame of the captured JSON.stringify it calls (one right
  // above a prelude frame: the cell's own unbound JSON.stringify shows the same, and stays).
  const HOST_FRAME = /^\s+at .*codemode-prelude\.js/;
  const STRINGIFY_FRAME = /^\s+at stringify \(<anonymous>\)$/;
  // The cell's first line shares its line with the host's wrapper (`wrapColumns` characters,
  // taken off every position V8 reports there) — but for the origin of an eval, which V8 gives
  // unadjusted: it is adjusted here.
  // Found by hand, in time linear in the line: the line holds the cell's error message, and
  // `/eval at [^()]*\(exec_main\.mjs:1:(\d+)\)/` scanned from every `eval at` to the next
  // parenthesis (a 1.6 MB message of `eval at ` took four minutes). Same matches: an origin
  // `(exec_main.mjs:1:N)` whose text back to the parenthesis before it holds an `eval at `.
  const EVAL_AT = 'eval at ';
  const ORIGIN_ON_LINE_1 = '(exec_main.mjs:1:';
  function shiftEvalOrigins(line) {
    let out = '';
    let done = 0; // line[0, done) is in `out`
    let origin = stringIndexOf(line, ORIGIN_ON_LINE_1, 0);
    while (origin >= 0) {
      const digits = origin + ORIGIN_ON_LINE_1.length;
      let end = digits;
      while (end < line.length && isDigit(charCodeAt(line, end))) end++;
      let paren = origin - 1; // scans stop at the previous origin's own parenthesis
      while (paren >= done && !isParen(charCodeAt(line, paren))) paren--;
      const between = paren + 1;
      if (end > digits && charCodeAt(line, end) === 41 &&
          stringIndexOf(stringSlice(line, between, origin), EVAL_AT, 0) >= 0) {
        out += stringSlice(line, done, digits) +
          (NumberOf(stringSlice(line, digits, end)) - wrapColumns) + ')';
        done = end + 1;
      }
      origin = stringIndexOf(line, ORIGIN_ON_LINE_1, origin + 1);
    }
    return done === 0 ? line : out + stringSlice(line, done);
  }
  // A cell whose source names it with `//# sourceURL=NAME` reports its frames as `NAME:L:C`, and
  // V8 takes no offset off them: on line 1 they count the wrapper's columns, taken off here. The
  // name is V8's own (host.js); null for a cell that has none.
  let sourceUrlOnLine1 = null; // 'NAME:1:'
  function shiftSourceUrlFrame(line) {
    if (sourceUrlOnLine1 === null) return line;
    let end = line.length;
    const closed = end > 0 && charCodeAt(line, end - 1) === 41;
    if (closed) end--;
    let digits = end;
    while (digits > 0 && isDigit(charCodeAt(line, digits - 1))) digits--;
    const place = digits - sourceUrlOnLine1.length;
    if (digits === end || place < 0 ||
        stringSlice(line, place, digits) !== sourceUrlOnLine1) return line;
    // The place of a frame: `at f (NAME:1:C)`, `at NAME:1:C` or `at async NAME:1:C`.
    const before = closed ? '(' : ' ';
    if (place < 1 || stringSlice(line, place - 1, place) !== before ||
        !reTest(FRAME_LINE, line)) return line;
    const column = NumberOf(stringSlice(line, digits, end));
    if (column <= wrapColumns) return line;
    return stringSlice(line, 0, digits) + (column - wrapColumns) + (closed ? ')' : '');
  }
  const FRAME_LINE = /^\s+at /;
  const isDigit = (code) => code >= 48 && code <= 57;
  const isParen = (code) => code === 40 || code === 41;
  // Strings are cut and joined by hand: split, replace, join and array iteration would each look
  // up something the cell can change (Symbol.split, RegExp.prototype[Symbol.replace], ...).
  function cleanStack(stack) {
    let out = '';
    let first = true;
    let end = stringIndexOf(stack, '\n', 0);
    if (end < 0) end = stack.length;
    let line = stringSlice(stack, 0, end);
    while (line !== null) {
      let next = null;
      if (end < stack.length) {
        const start = end + 1;
        end = stringIndexOf(stack, '\n', start);
        if (end < 0) end = stack.length;
        next = stringSlice(stack, start, end);
      }
      const ours = reTest(HOST_FRAME, line) ||
        (next !== null && reTest(STRINGIFY_FRAME, line) && reTest(HOST_FRAME, next));
      if (!ours) {
        out += (first ? '' : '\n') + shiftSourceUrlFrame(shiftEvalOrigins(line));
        first = false;
      }
      line = next;
    }
    return out;
  }
  // A value JavaScript cannot convert to a string (a symbol, an object without usable toString
  // or valueOf) has the empty text, as on the upstream host.
  function errorText(value) {
    try {
      if (value !== null && (typeof value === 'object' || typeof value === 'function')) {
        const stack = value.stack;
        if (typeof stack === 'string') return cleanStack(stack);
      }
      return `${value}`;
    } catch (error) {
      return '';
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

  // -- JSON the host would not accept ------------------------------------------------------------
  // The upstream host parses the JSON text of a tool input or a stored value with a parser that
  // refuses a lone surrogate escape (JSON.stringify writes one for a lone surrogate) and nesting
  // 128 deep. Its texts, with the place given as the parser gives it: line 1 (JSON.stringify
  // writes no newline), the column in UTF-8 bytes of the last byte read.
  const SERIALIZE_FAILED = 'failed to serialize JavaScript value: ';
  const EXPECTED_VALUE = SERIALIZE_FAILED + 'expected value at line 1 column 1';
  const MAX_JSON_DEPTH = 128;

  function hexAt(json, at) {
    const value = NumberOf('0x' + stringSlice(json, at, at + 4));
    return value === value ? value : -1;
  }

  // The host's refusal of `json` (JSON.stringify output), or null.
  function jsonRefusal(json) {
    const n = json.length;
    if (n < MAX_JSON_DEPTH && stringIndexOf(json, '\\u') < 0) return null;
    let column = 0;
    let depth = 0;
    let inString = false;
    const refuse = (what, at) => SERIALIZE_FAILED + what + ' at line 1 column ' + at;
    for (let i = 0; i < n; i++) {
      const code = charCodeAt(json, i);
      column += code < 0x80 ? 1 : code < 0x800 || (code >= 0xd800 && code <= 0xdfff) ? 2 : 3;
      if (!inString) {
        if (code === 0x5b || code === 0x7b) { // [ {
          depth++;
          if (depth >= MAX_JSON_DEPTH) return refuse('recursion limit exceeded', column);
        } else if (code === 0x5d || code === 0x7d) {
          depth--;
        } else if (code === 0x22) {
          inString = true;
        }
        continue;
      }
      if (code === 0x22) {
        inString = false;
      } else if (code === 0x5c) { // backslash: escapes are ASCII, one byte a character
        i++;
        column++;
        if (charCodeAt(json, i) !== 0x75) continue; // not \\u
        const unit = hexAt(json, i + 1);
        i += 4;
        column += 4;
        if (unit >= 0xdc00 && unit <= 0xdfff) return refuse('lone leading surrogate in hex escape', column);
        if (unit < 0xd800 || unit > 0xdbff) continue;
        // A high surrogate must be followed by `\\u` and a low one.
        if (charCodeAt(json, i + 1) !== 0x5c) return refuse('unexpected end of hex escape', column + 1);
        if (charCodeAt(json, i + 2) !== 0x75) return refuse('unexpected end of hex escape', column + 2);
        const low = hexAt(json, i + 3);
        i += 6;
        column += 6;
        if (low < 0xdc00 || low > 0xdfff) return refuse('lone leading surrogate in hex escape', column);
      }
    }
    return null;
  }

  // -- cell state --------------------------------------------------------------------------------
  // `settled`: the cell's end is decided (its body returned or threw, or exit() ran); nothing of
  // it starts any more (tool calls, timers, deliveries). `finished`: its helpers are no-ops too.
  // A cell that completed (or threw) is settled but not finished: the microtasks it left run to
  // the end of this turn, and what they emit is part of its result — the upstream host drains
  // them before it reports one. host.js sends the result when the turn has ended.
  let settled = false;
  let finished = false;
  let rewritten = false; // a store came after the end was decided
  const stored = new MapCtor(); // key -> JSON text, or null: absent (snapshot + own writes)
  let fetchStored = null; // host.js: the snapshot's text of a key not in `stored` (a large store)
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

  // [[key, JSON text], ...]: each value travels as a string, so that the host can count the
  // entries without reading the values (host.js, engine.py).
  function writesJson() {
    let out = '[';
    const entries = mapEntries(written);
    for (let step = iteratorNext(entries); !step.done; step = iteratorNext(entries)) {
      if (out.length > 1) out += ',';
      out += '[' + stringify(toWellFormed(step.value[0])) + ',' + stringify(toWellFormed(step.value[1])) + ']';
    }
    return out + ']';
  }

  // Ends the cell as a natural completion (`final`: exit(), whose helpers stop at once too).
  function finish(errorTextOrNull, site, final) {
    if (settled) return;
    settled = true;
    if (final) finished = true;
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
    if (mapSize(failures) >= FAILURES_KEPT) mapDelete(failures, iteratorNext(mapEntries(failures)).value[0]);
    mapSet(failures, text, [pending[3], pending[2]]);
  }

  // The stack of a site as V8 itself formats it: the cell's Error.prepareStackTrace (which would
  // see this file's frame, and which upstream never calls for a site it has not) is set aside
  // while the stack is read, then put back as it was. One the cell made unchangeable costs the
  // site (null), nothing else.
  const PREPARE = 'prepareStackTrace';
  function engineFormatted(site) {
    const saved = getOwnPropertyDescriptor(ErrorCtor, PREPARE);
    if (saved !== undefined) {
      if (!saved.configurable) return null;
      setPrototypeOf(saved, null); // read back as it is, whatever Object.prototype holds
    }
    defineProperty(ErrorCtor, PREPARE, { __proto__: null, value: undefined, writable: true, configurable: true });
    try {
      return site.stack;
    } finally {
      if (saved === undefined) deleteProperty(ErrorCtor, PREPARE);
      else defineProperty(ErrorCtor, PREPARE, saved);
    }
  }

  // [tool index, line, column] of the failed call whose text `error` is, or null.
  function failedCallSite(error) {
    if (typeof error !== 'string' || failures === null) return null;
    const failure = mapGet(failures, error);
    if (failure === undefined) return null;
    try {
      const stack = engineFormatted(failure[1]);
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

  // Array.isArray throws for a revoked proxy; upstream's native check sees no array there.
  function isArrayValue(value) {
    try {
      return isArray(value);
    } catch (error) {
      return false;
    }
  }

  function isPlainObject(value) {
    return value !== null && typeof value === 'object' && !isArrayValue(value);
  }

  // What a media helper reads of its argument, as the upstream host does: the URL property and
  // the detail, each read once; without a URL the argument's JSON (JSON.stringify's view: own
  // properties, toJSON()), read as an MCP block. A function or an object whose toJSON() gives
  // undefined has no JSON and throws. Anything else: null.
  const MCP_KEYS = ['type', 'data', 'mimeType', 'mime_type', '_meta'];
  function mediaFields(value, urlKey) {
    if ((typeof value !== 'object' && typeof value !== 'function') || value === null || isArrayValue(value)) {
      return null;
    }
    const fields = { __proto__: null };
    let url;
    try {
      url = value[urlKey];
    } catch (error) {
      if (error === EXIT) throw error;
      throw errorText(error); // as its text, as upstream
    }
    if (url !== undefined) {
      fields[urlKey] = url;
      if (urlKey === 'image_url') {
        // A `detail` whose read throws counts as absent: the item is made all the same and the
        // exception comes after it (unless the helper fails first), as on the upstream host.
        try {
          fields.detail = value.detail;
        } catch (error) {
          if (error === EXIT) throw error;
          fields.thrown = [error];
        }
      }
      return fields;
    }
    let json;
    try {
      json = stringify(value);
    } catch (error) {
      throw errorText(error);
    }
    if (json === undefined) throw EXPECTED_VALUE;
    const refusal = jsonRefusal(json);
    if (refusal !== null) throw refusal;
    const block = parse(json);
    if (!isPlainObject(block)) return null;
    // Own properties only: what a cell put on Object.prototype is no part of the JSON.
    for (let i = 0; i < MCP_KEYS.length; i++) fields[MCP_KEYS[i]] = ownValue(block, MCP_KEYS[i]);
    return fields;
  }

  // A property of a value made by JSON.parse, if it is its own.
  function ownValue(object, key) {
    return hasOwn(object, key) ? object[key] : undefined;
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
    const colon = stringIndexOf(url, ':');
    return colon < 0 ? null : toLower(stringSlice(url, 0, colon));
  }

  function checkDetailType(detail) {
    if (detail !== undefined && detail !== null && typeof detail !== 'string') {
      throw 'image detail must be a string when provided';
    }
  }

  function checkDetail(detail) {
    if (detail === undefined || detail === null) return undefined;
    if (typeof detail !== 'string') throw 'image detail must be a string when provided';
    const lowered = toLower(detail);
    if (!within(DETAILS, lowered)) throw 'image detail must be one of: auto, low, high, original';
    return lowered;
  }

  // `value`: a string, or the fields (mediaFields) of an object, or null for anything else.
  function imageItem(value, detailArgument) {
    let url;
    let embedded;
    let metaDetail;
    if (typeof value === 'string') {
      url = value;
    } else if (value !== null && value.image_url !== undefined) {
      if (typeof value.image_url !== 'string') throw IMAGE_ANY;
      url = value.image_url;
      embedded = value.detail;
    } else if (value !== null && typeof value.type === 'string') {
      if (value.type !== 'image') throw 'image only accepts MCP image blocks, got "' + value.type + '"';
      url = mcpDataUrl(value, 'image expected MCP image data');
      const meta = value._meta;
      const hinted = isPlainObject(meta) ? ownValue(meta, 'codex/imageDetail') : undefined;
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
    // Both must be strings if given; only the one used must name a detail (as upstream).
    checkDetailType(embedded);
    checkDetailType(detailArgument);
    const fromArgument = checkDetail(detailArgument);
    const fromObject = fromArgument === undefined ? checkDetail(embedded) : undefined;
    const detail = fromArgument !== undefined ? fromArgument : (fromObject !== undefined ? fromObject : metaDetail);
    return [url, detail === undefined ? 'high' : detail];
  }

  function image(value, detail) {
    // Indexed, not destructured: destructuring runs Array.prototype[Symbol.iterator], the cell's.
    const fields = typeof value === 'string' ? value : mediaFields(value, 'image_url');
    const item = imageItem(fields, detail);
    emit('input_image', item[0], item[1]);
    if (fields !== null && typeof fields === 'object' && fields.thrown !== undefined) throw fields.thrown[0];
  }

  function generatedImage(result) {
    // A function is an object here (as upstream): its properties are read, and its JSON (none)
    // throws only where a block would be read.
    if (typeof result !== 'function' && !isPlainObject(result)) {
      throw 'generatedImage expects an image generation result object';
    }
    let hint;
    try {
      hint = result.output_hint;
    } catch (error) {
      if (error === EXIT) throw error;
      throw 'failed to read generatedImage output_hint'; // upstream's text, whatever was thrown
    }
    if (hint !== undefined && typeof hint !== 'string') {
      throw 'generatedImage output_hint must be a string when provided';
    }
    const fields = mediaFields(result, 'image_url');
    const item = imageItem(fields, undefined);
    emit('input_image', item[0], item[1]);
    if (hint !== undefined) emit('input_text', hint);
    if (fields !== null && fields.thrown !== undefined) throw fields.thrown[0];
  }

  const SHORT_AUDIO = 'Audio output omitted because the clip is shorter than 25 ms; use a longer clip.';
  const BASE64_DATA_URL = /^data:[^,]*;base64,/i;

  function audio(argument) {
    let url;
    const value = typeof argument === 'string' ? argument : mediaFields(argument, 'audio_url');
    if (typeof value === 'string') {
      url = value;
    } else if (value !== null && value.audio_url !== undefined) {
      if (typeof value.audio_url !== 'string') throw AUDIO_ANY;
      url = value.audio_url;
    } else if (value !== null && typeof value.type === 'string') {
      if (value.type !== 'audio') throw 'audio only accepts MCP audio blocks, got "' + value.type + '"';
      url = mcpDataUrl(value, 'audio expected MCP audio data');
    } else {
      throw AUDIO_ANY;
    }
    if (url === '') throw AUDIO_ANY;
    if (schemeOf(url) !== 'data') {
      throw 'Tool call failed: invalid audio output. Pass a base64 data URI instead';
    }
    const match = reExec(BASE64_DATA_URL, url);
    if (match !== null && isShortWav(url, match[0].length)) {
      emit('input_text', SHORT_AUDIO);
    } else {
      emit('input_audio', url);
    }
  }

  // WAV clip shorter than 25 ms? (runtime.md §5.5) Reads the base64 text in place (a byte at a
  // time, only where the RIFF chunk headers are); not measurable -> false (keep the audio).
  // Only canonical standard base64 decodes, as on the upstream host: its alphabet (no `-`, `_`),
  // a length that is a multiple of 4 with its `=` padding, no bits set past the last byte.
  function sextet(code) {
    if (code >= 65 && code <= 90) return code - 65;
    if (code >= 97 && code <= 122) return code - 71;
    if (code >= 48 && code <= 57) return code + 4;
    if (code === 43) return 62;
    if (code === 47) return 63;
    return -1;
  }
  function isCanonicalBase64(url, start) {
    const n = url.length - start;
    if (n % 4 !== 0) return false;
    let end = url.length;
    while (end > start && url.length - end < 2 && charCodeAt(url, end - 1) === 61) end--;
    for (let i = start; i < end; i++) if (sextet(charCodeAt(url, i)) < 0) return false;
    const padding = url.length - end;
    if (padding === 0) return true;
    const last = sextet(charCodeAt(url, end - 1));
    return padding === 1 ? last % 4 === 0 : last % 16 === 0;
  }
  function isShortWav(url, start) {
    return isShortWavClip(url, start) && isCanonicalBase64(url, start);
  }
  function isShortWavClip(url, start) {
    let end = url.length;
    while (end > start && charCodeAt(url, end - 1) === 61) end--; // '=' padding
    const total = floor(((end - start) * 3) / 4);
    const byteAt = (index) => {
      const group = start + floor(index / 3) * 4;
      let bits = 0;
      for (let k = 0; k < 4; k++) {
        const at = group + k;
        const value = at < end ? sextet(charCodeAt(url, at)) : 0;
        if (value < 0) throw 0;
        bits = bits * 64 + value;
      }
      return floor(bits / 2 ** (8 * (2 - (index % 3)))) % 256;
    };
    const u32 = (i) => byteAt(i) + byteAt(i + 1) * 256 + byteAt(i + 2) * 65536 + byteAt(i + 3) * 16777216;
    const u16 = (i) => byteAt(i) + byteAt(i + 1) * 256;
    const tag = (i) => fromCharCode(byteAt(i), byteAt(i + 1), byteAt(i + 2), byteAt(i + 3));
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
          usable = min(size, total - body);
        }
        offset = body + size + (size % 2);
      }
      if (usable < 0 || rate === 0 || align === 0) return false;
      return floor(usable / align) * 40 < rate;
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

  // Rust's debug escaping writes \u{…} for every character that is not printable (a control,
  // format, private-use, unassigned or surrogate code point, a line or paragraph separator, any
  // space but U+0020) and for every grapheme extender. Its Unicode tables differ from this
  // engine's in a few characters (compared over every code point with the upstream host).
  // Made on first use: building this class of Unicode properties takes ≈0.3 ms, which every
  // isolate would pay while the prelude is installed, for a text few cells ever need.
  let escapedInDebug = null;
  const escapedInDebugPattern = () => escapedInDebug || (escapedInDebug =
    /^(?![\uff9e\uff9f])[\p{Cc}\p{Cf}\p{Cs}\p{Co}\p{Cn}\p{Zl}\p{Zp}\p{Zs}\p{Grapheme_Extend}\u115f\u1160\u3164\uffa0]$/u);
  function debugQuote(key) {
    let out = '"';
    for (let i = 0; i < key.length; i++) {
      const code = codePointAt(key, i);
      const ch = fromCodePoint(code);
      if (code > 0xffff) i++;
      if (ch === '"') out += '\\"';
      else if (ch === '\\') out += '\\\\';
      else if (ch === '\t') out += '\\t';
      else if (ch === '\r') out += '\\r';
      else if (ch === '\n') out += '\\n';
      else if (ch === '\0') out += '\\0';
      else if (ch !== ' ' && reTest(escapedInDebugPattern(), ch)) out += '\\u{' + hex(code) + '}';
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

  // A key is its JavaScript string (ToString; lone surrogates become U+FFFD, as the upstream host
  // stores it); one that has none throws (upstream's texts).
  function keyName(key, refusal) {
    let name;
    try {
      name = `${key}`;
    } catch (error) {
      throw refusal;
    }
    return toWellFormed(name);
  }

  function store(key, value) {
    const name = keyName(key, 'store key must be a string');
    let serialized;
    try {
      serialized = stringify(value, rejectReserved);
    } catch (error) {
      if (error === RESERVED) throw 'failed to serialize JavaScript value: reserved JSON object key';
      throw errorText(error);
    }
    if (serialized === undefined) {
      // Only `undefined` itself is "unable to store"; a function, a symbol or a toJSON() that
      // returns undefined fail in the host's parser (both checked upstream).
      if (value !== undefined) throw EXPECTED_VALUE;
      throw 'Unable to store ' + debugQuote(name) + '. Only plain serializable objects can be stored.';
    }
    const refusal = jsonRefusal(serialized);
    if (refusal !== null) throw refusal;
    if (finished) return;
    const previous = mapGet(written, name);
    const grown = previous === undefined
      ? storeChars + STORE_ENTRY_CHARS + name.length + serialized.length
      : storeChars + serialized.length - previous.length;
    if (grown > MAX_STORE_CHARS) {
      throw 'store exceeds the limit of ' + MAX_STORE_CHARS + ' characters written per cell';
    }
    storeChars = grown;
    mapSet(stored, name, serialized);
    mapSet(written, name, serialized);
    // A leftover microtask's store, after the writes went out with the cell's end: the host asks
    // for them again when the turn ends (they are committed, as on the upstream host).
    if (settled && !rewritten) {
      rewritten = true;
      hostRewritten();
    }
  }

  function load(key) {
    const name = keyName(key, 'load key must be a string');
    let serialized = mapGet(stored, name);
    if (serialized === undefined && fetchStored !== null) {
      serialized = fetchStored(name);
      if (typeof serialized !== 'string') serialized = null;
      mapSet(stored, name, serialized); // fetched once: the snapshot does not change
    }
    return typeof serialized === 'string' ? parse(serialized) : undefined;
  }

  // -- notify / yield / exit (§7-§9) --------------------------------------------------------------
  // Blank: Unicode White_Space only (the upstream host's trim), not JavaScript's trim().
  const BLANK = /^\p{White_Space}*$/u;
  function notify(value) {
    const message = valueToText(value);
    if (reTest(BLANK, message)) throw 'notify expects non-empty text';
    if (finished) return;
    if (notifyBudget <= 0) throw 'notify exceeded the limit of ' + MAX_NOTIFICATIONS + ' notifications per cell';
    notifyBudget--;
    hostNotify(toWellFormed(message));
  }

  // A second yield in the same turn changes nothing (decision 0004): it is not sent.
  let yieldedTurn = -1;
  function yield_control() {
    if (settled || yieldedTurn === turn) return;
    yieldedTurn = turn;
    hostYield(turn);
  }

  // Nothing of the cell is observable after exit(): the host disposes the isolate on `finish`, and
  // until then every helper is a no-op. The throw unwinds whatever the cell was doing.
  // EXIT itself can be caught (a `catch`, a `finally`): the host stops the isolate on hostExit,
  // so that no code of the cell runs after it (runtime.md §9), also when exit() comes after the
  // end was decided (a leftover microtask; the writes then go with it, as they are now).
  const EXIT = {};
  function exit() {
    const decided = settled;
    finish(null, null, true);
    finished = true;
    let writes = null;
    if (decided && rewritten) {
      try {
        writes = writesJson();
      } catch (error) {
        writes = null;
      }
    }
    hostExit(writes);
    throw EXIT;
  }

  // -- timers (§10) ------------------------------------------------------------------------------
  function setTimeout(callback, delay) {
    if (typeof callback !== 'function') throw 'setTimeout expects a function callback';
    let ms;
    try {
      ms = +delay; // ToNumber: a bigint or a symbol throws its TypeError (as upstream)
    } catch (error) {
      // The engine made that TypeError here: its stack starts at the cell's call, as upstream's.
      const type = typeof delay;
      if ((type === 'symbol' || type === 'bigint') && error !== null && typeof error === 'object') {
        captureStackTrace(error, setTimeout);
      }
      throw error;
    }
    ms = !isFiniteNumber(ms) || ms <= 0 ? 0 : trunc(ms);
    const id = nextTimer++;
    if (settled) return id;
    if (mapSize(timers) >= MAX_TIMERS) throw 'setTimeout exceeded the limit of ' + MAX_TIMERS + ' pending timers';
    mapSet(timers, id, callback);
    hostSetTimer(id, ms);
    return id;
  }

  // An id without a number (ToNumber throws: a symbol, a bigint, an object whose valueOf throws)
  // is refused; any other is converted and looked up.
  function clearTimeout(id) {
    let number;
    try {
      number = +id;
    } catch (error) {
      throw 'clearTimeout expects a numeric timeout id';
    }
    if (number !== number || !isFiniteNumber(number) || number <= 0) return;
    const key = trunc(number);
    if (mapDelete(timers, key)) hostClearTimer(key);
  }

  // -- tools (§4) --------------------------------------------------------------------------------
  function makeTool(index) {
    return function (...args) {
      // JSON round trip of the argument; a throw here happens before any promise exists.
      // No argument or `undefined`: no input. Anything else JSON.stringify turns into nothing (a
      // function, a symbol, a toJSON() returning undefined) throws, as do what JSON.stringify
      // throws (as its text) and JSON the upstream host refuses: what that host does, checked
      // against its releases, beside runtime.md §4.3's text.
      const argument = args[0];
      let input;
      if (argument !== undefined) {
        try {
          input = stringify(argument);
        } catch (error) {
          throw errorText(error);
        }
        if (input === undefined) throw EXPECTED_VALUE;
        if (input.length > MAX_TOOL_INPUT_CHARS) {
          throw 'tool input of ' + input.length + ' characters exceeds the limit of ' + MAX_TOOL_INPUT_CHARS + ' characters';
        }
        const refusal = jsonRefusal(input);
        if (refusal !== null) throw refusal;
      }
      if (mapSize(pendingCalls) >= MAX_PENDING_CALLS) {
        // Refused like any call over a limit (a rejection), without a word to the host.
        return rejected('too many pending tool calls in this cell (limit ' + MAX_PENDING_CALLS + ')');
      }
      const id = 'tool-' + nextCall++;
      // Not an Error: its text (formatted only if the call fails) reads no name or message of
      // the cell's Error.prototype.
      const site = { __proto__: null };
      captureStackTrace(site);
      return new PromiseCtor((resolve, reject) => {
        if (settled) return;
        mapSet(pendingCalls, id, [resolve, reject, site, index]);
        hostCall(id, index, input === undefined ? null : toWellFormed(input));
      });
    };
  }

  function install(name, value) {
    defineProperty(g, name, { value, writable: true, configurable: true, enumerable: true });
  }

  // The helpers and tools look like the upstream host's functions, made in native code: no name,
  // no declared parameters, `function () { [native code] }` as their source text (a bound
  // function's), and a prototype object.
  function opaque(fn) {
    const f = bindFunction(fn, undefined);
    defineProperty(f, 'name', { value: '', configurable: true });
    defineProperty(f, 'length', { value: 0, configurable: true });
    const prototype = {};
    defineProperty(prototype, 'constructor', { value: f, writable: true, configurable: true });
    defineProperty(f, 'prototype', { value: prototype, writable: true });
    return f;
  }

  // -- the host's way in ---------------------------------------------------------------------------
  // `turn` counts the host's entries into the isolate: two yield_control() calls in one
  // uninterrupted run of the cell share a turn (decision 0004).
  let turn = 0;

  // `wholeStore`: the store as JSON text [[key, json text]], or null with `fetch` (host.js).
  function configure(configJson, wholeStore, fetch) {
    const config = parse(configJson);
    const tools = {};
    for (const [identifier, index] of config.tools) {
      // The last tool with an identifier wins. Defined, not assigned: a tool named `__proto__`
      // is a property like any other (as on upstream 0.171.0).
      defineProperty(tools, identifier, {
        value: opaque(makeTool(index)), writable: true, enumerable: true, configurable: true,
      });
    }
    // Enumerable, in the upstream host's order (what `Object.keys(globalThis)` shows).
    install('tools', tools);
    install('ALL_TOOLS', config.all);
    install('clearTimeout', opaque(clearTimeout));
    install('setTimeout', opaque(setTimeout));
    install('text', opaque(text));
    install('image', opaque(image));
    install('audio', opaque(audio));
    install('generatedImage', opaque(generatedImage));
    if (config.store) {
      if (typeof wholeStore === 'string') {
        for (const [key, serialized] of parse(wholeStore)) mapSet(stored, key, serialized);
      } else if (typeof fetch === 'function') {
        fetchStored = fetch;
      }
      install('store', opaque(store));
      install('load', opaque(load));
    }
    install('notify', opaque(notify));
    install('yield_control', opaque(yield_control));
    install('exit', opaque(exit));
    if (config.console) install('console', makeConsole());
  }

  // Every dynamic import() of the cell is renamed to a call of this (host.js).
  const dynamicImport = () => rejected('unsupported import in exec');

  // `wrapper` takes the dynamic-import function and returns the cell as an async function.
  // Cell code (the cell's body, a timer callback) is called from a microtask (later()), so that no
  // frame of this file sits under the cell's body: its stack traces show only the cell's own frames.

  function run(wrapper, sourceUrl) {
    if (typeof sourceUrl === 'string') sourceUrlOnLine1 = sourceUrl + ':1:';
    let cell;
    try {
      cell = apply(wrapper, undefined, [dynamicImport]);
    } catch (error) {
      finish(errorText(error));
      return;
    }
    later(cell, settleCell, failLater);
  }

  // `later(handler, settled, failed)` calls `handler` from a microtask (no frame of this file under
  // it) and hands what it returns to `settled`, what it throws to `failed`, without a lookup that
  // cell code could redirect: nothing here reads `then`, `constructor` or `Symbol.species` of a
  // promise the cell can reach, so overriding them changes only what the cell itself sees, as on
  // the upstream host. The reaction's result goes to a capability of ours (`Capability`, named as
  // the species of the start promise), not into a promise that would look up its `then`.
  let capabilityResolve = null;
  let capabilityReject = null;
  function Capability(executor) {
    executor(capabilityResolve, capabilityReject);
  }
  const CAPABILITY = ObjectCtor.freeze({ __proto__: null, [SymbolSpecies]: Capability });
  // Without a prototype: a descriptor inherits no `get` or `set` a cell put on Object.prototype.
  const PINNED_TO_CAPABILITY = ObjectCtor.freeze({ __proto__: null, value: CAPABILITY });
  const resolveAtOnce = (resolve) => resolve();
  function later(handler, settled, failed) {
    const start = new PromiseCtor(resolveAtOnce);
    defineProperty(start, 'constructor', PINNED_TO_CAPABILITY);
    capabilityResolve = settled;
    capabilityReject = failed;
    try {
      promiseThen(start, handler);
    } finally {
      capabilityResolve = capabilityReject = null;
    }
  }

  // The cell's own promise (an async function's) is watched with reactions, not awaited: an
  // `await` of it would put this file's frame (`async settleCell`) under every stack the cell
  // reads after its first await. Its `constructor` is pinned (an own property of a promise the
  // cell never sees) to our capability, so that watching it looks up nothing of the cell's, and
  // the cell's async stack traces end at its own frames (V8 follows a reaction only into a
  // promise). The ticks are those of resolving a promise with it (a then-job, its reaction, the
  // reaction of the resolved promise).
  function settleCell(promise) {
    defineProperty(promise, 'constructor', PINNED_TO_CAPABILITY);
    later(() => {
      capabilityResolve = capabilityReject = ignore;
      try {
        promiseThen(promise, cellReturned, cellThrew);
      } finally {
        capabilityResolve = capabilityReject = null;
      }
    }, ignore, ignore);
  }
  const finishCompleted = () => finish(null);
  const cellReturned = () => later(finishCompleted, ignore, ignore);
  const cellThrew = (error) => later(() => fail(error), ignore, ignore);

  async function failLater(error) {
    await undefined;
    fail(error);
  }

  // resultsJson: [[runtime tool call id, ok, value or error text], ...]
  function deliver(resultsJson) {
    if (settled) return;
    const results = parse(resultsJson);
    for (let i = 0; i < results.length; i++) {
      const result = results[i];
      const id = result[0];
      const ok = result[1];
      const value = result[2];
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
    if (callback === undefined || settled) return;
    mapDelete(timers, id);
    // Only what the callback throws ends the cell; a promise it returns is not awaited (§2.5).
    // Called by the microtask itself, through a bound Reflect.apply (neither shows as a frame),
    // without arguments and `this`: the callback's stacks show only the cell's own frames.
    later(bindFunction(apply, undefined, callback, undefined, NO_ARGUMENTS), ignore, failLater);
  }

  return function entry(kind, a, b, c) {
    if (kind === 'configure') configure(a, b, c);
    else if (kind === 'run') run(a, b);
    else if (kind === 'fail') finish(a);
    else if (kind === 'deliver') {
      turn += 1;
      deliver(a);
    } else if (kind === 'timer') {
      turn += 1;
      fireTimer(a);
    } else if (kind === 'writes') {
      return writesJson();
    }
    return undefined;
  };
});
