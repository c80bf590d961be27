"""Large JSON texts decoded a piece at a time, so that the event loop runs in between.

msgspec holds the GIL through each call, and decodes text that JSON escapes (a backslash, a
control character) at 250-500 MB/s: a frame of the engine's that carries one string of 63 M
backslashes (252 MB of JSON) held the event loop every session shares for about a second,
whether it was decoded on that loop or on a worker thread. Here the long string literals of a
JSON text (:data:`LONG` units or more) are found and decoded :data:`PIECE` units at a time, each
piece a C call of its own; the rest of the text, its *skeleton* (each long literal replaced by a
placeholder), is decoded in one call, and the literals' strings are then put in place of their
placeholders (:func:`put_back`, or by the caller for typed messages). Run on a worker thread, the
loop gets the GIL between the pieces (the switch interval, 5 ms).

Works on UTF-8 bytes (an engine frame) and on ``str`` (a text carried inside one: a tool input,
a cell's store writes). A text that is JSON, however it escapes, gives the value a whole decode
gives (a piece is cut only where its decode proves the cut clean: never inside an escape, a UTF-8
sequence or a surrogate pair). Nothing is trusted: a text that is not JSON fails to decode
(:class:`msgspec.DecodeError`), or, should a backslash outside its strings mislead the scan, gives
some value no larger than the text (what the engine sends is its own to spoil).

The other way, :func:`encode` writes a JSON value as one encode would, each C call handling
about a :data:`PIECE` of it: a host that sends a cell's tool input, notification or output item
to its client encodes it so (on a worker thread) when it is large.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Final

import msgspec

__all__ = ["LONG", "PIECE", "Split", "encode", "heavy", "put_back", "split"]

#: The units (characters, or bytes of UTF-8) of a text one C call handles here.
PIECE: Final = 256 * 1024
#: A string literal this long or longer is decoded in pieces. Longer than a stretch of the scan,
#: it opens at a stretch's last quote and closes at a later one's first: the scan looks at no
#: other quote one by one.
LONG: Final = 4 * PIECE
_STRING: Final = msgspec.json.Decoder(str)
_ENCODER: Final = msgspec.json.Encoder()
#: How far back from a stretch's end a cut is looked for: an escape is at most 6 units, a
#: surrogate pair's two escapes 12.
_BACK: Final = 12


@dataclass(frozen=True, slots=True)
class _Marks:
    quote: Any
    backslash: Any
    pair: Any  # an escaped backslash
    escaped_quote: Any
    blank: Any  # two units that are neither
    empty: Any


_STR_MARKS: Final = _Marks('"', "\\", "\\\\", '\\"', "__", "")
_BYTES_MARKS: Final = _Marks(b'"', b"\\", b"\\\\", b'\\"', b"__", b"")


@dataclass(frozen=True, slots=True)
class Split:
    """A JSON text's skeleton, and the spans of the long literals it replaced by placeholders."""

    skeleton: Any  # str or bytes, as the text
    text: Any
    spans: list[tuple[int, int]]  # (start, end) of each long literal's body in ``text``
    placeholders: list[str]

    def strings(self) -> dict[str, str]:
        """Each placeholder's string: its literal, decoded a piece at a time (malformed:
        :class:`msgspec.DecodeError`)."""
        return {
            placeholder: _decoded_body(self.text, start, end)
            for placeholder, (start, end) in zip(self.placeholders, self.spans, strict=True)
        }


def split(text: str | bytes | bytearray, start: int = 0, end: int | None = None) -> Split:
    """``text[start:end]``, a JSON text, with each string literal of :data:`LONG` units or more
    replaced by a placeholder of its own (a fresh random name: no text a cell wrote holds one).

    The text is read :data:`PIECE` units at a time. In each stretch, escaped backslashes and
    escaped quotes are blanked (left to right from a point where no escape is open: a stretch
    never ends between a backslash and what it escapes), so that its remaining quotes are those
    that open or close strings. An unterminated literal is malformed (:class:`msgspec.DecodeError`);
    a text that is not JSON otherwise gives some skeleton, whose decoding then fails or gives a
    value as bounded as the text.
    """
    marks = _STR_MARKS if isinstance(text, str) else _BYTES_MARKS
    end = len(text) if end is None else end
    spans: list[tuple[int, int]] = []
    inside = False
    opened = 0
    i = start
    quote, backslash = marks.quote, marks.backslash
    while i < end:
        j = min(i + PIECE, end)
        stretch: Any = text[i:j]
        if j < end and stretch.endswith(backslash):
            run = len(stretch) - len(stretch.rstrip(backslash))
            # All backslashes from a point where no escape is open: pairs, cut after an even
            # number; else cut before the run, which starts an escape.
            keep = run - run % 2 if run == len(stretch) else len(stretch) - run
            j = i + keep
            stretch = stretch[:keep]
        if quote in stretch:
            if backslash in stretch:
                stretch = stretch.replace(marks.pair, marks.blank).replace(
                    marks.escaped_quote, marks.blank
                )
            quotes = stretch.count(quote)
            if inside and quotes:
                close = i + stretch.find(quote)
                if close - opened >= LONG:
                    spans.append((opened, close))
                quotes -= 1
                inside = False
            if quotes % 2:
                inside = True
                opened = i + stretch.rfind(quote) + 1
        i = j
    if inside:
        raise msgspec.DecodeError("JSON is malformed: unterminated string")
    if not spans:
        whole = text if start == 0 and end == len(text) else text[start:end]
        return Split(whole, text, [], [])
    nonce = secrets.token_hex(16)
    placeholders = [f"codemode-piece-{nonce}-{index}" for index in range(len(spans))]
    parts: list[Any] = []
    last = start
    for placeholder, (opened, close) in zip(placeholders, spans, strict=True):
        parts.append(text[last:opened])  # up to the literal's opening quote, included
        parts.append(placeholder if isinstance(text, str) else placeholder.encode())
        last = close  # its closing quote
    parts.append(text[last:end])
    return Split(marks.empty.join(parts), text, spans, placeholders)


def _decoded_body(text: Any, start: int, end: int) -> str:
    """The string whose JSON literal's body is ``text[start:end]``, decoded a piece at a time."""
    marks = _STR_MARKS if isinstance(text, str) else _BYTES_MARKS
    quote = marks.quote
    pieces: list[str] = []
    while start < end:
        stop = end if end - start <= PIECE else start + PIECE
        for cut in _cuts(text, start, stop, end, marks):
            try:
                piece = _STRING.decode(quote + text[start:cut] + quote)
            except msgspec.DecodeError:
                continue  # the cut was inside an escape, a UTF-8 sequence or a surrogate pair
            break
        else:
            raise msgspec.DecodeError("JSON is malformed: an invalid string")
        pieces.append(piece)
        start = cut
    return "".join(pieces)


def _cuts(text: Any, start: int, stop: int, end: int, marks: _Marks) -> list[int]:
    """Where a piece from ``start`` may end, near ``stop``, most likely first. Each is proved by
    decoding the piece: a cut inside an escape leaves it open (``\\"`` then escapes the closing
    quote, or a hex digit is missing), one between a surrogate pair's escapes leaves a lone
    surrogate, one inside a UTF-8 sequence leaves it short; msgspec refuses all of them."""
    if stop == end:
        return [end]
    backslash = marks.backslash
    cuts: list[int] = []
    if text[stop - 1 : stop] == backslash:
        # A run of backslashes ends the piece. It starts an escape (or the piece, where no escape
        # is open): its pairs are escapes of a backslash each, and an odd one out starts one that
        # is not complete.
        piece: Any = text[start:stop]
        run = len(piece) - len(piece.rstrip(backslash))
        cuts.append(stop - run % 2)
    tail: Any = text[max(start + 1, stop - _BACK) : stop]
    base = stop - len(tail)
    position = tail.rfind(backslash)
    while position >= 0:
        cuts.append(base + position)  # before an escape
        position = tail.rfind(backslash, 0, position)
    if isinstance(text, str):
        cuts.append(stop)
    else:
        cut = stop
        while cut > start + 1 and text[cut] & 0xC0 == 0x80:  # a UTF-8 continuation byte
            cut -= 1
        cuts.append(cut)
    return [cut for cut in cuts if start < cut <= stop]


def put_back(value: Any, strings: dict[str, str], *, unique: bool = False) -> Any:
    """``value`` (decoded from a skeleton) with each placeholder, as a string or an object's key,
    replaced by its string; a loop of Python over its containers (on a worker thread, the event
    loop gets the GIL every switch interval). ``unique``: a key put back that an object already
    has (its text repeated a key) raises ``ValueError``."""
    if not strings:
        return value
    if isinstance(value, str):
        return strings.get(value, value)
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            for index, item in enumerate(node):
                if isinstance(item, str):
                    if item in strings:
                        node[index] = strings[item]
                elif isinstance(item, list | dict):
                    stack.append(item)
        elif isinstance(node, dict):
            renamed = False
            for key, item in node.items():
                if key in strings:
                    renamed = True
                if isinstance(item, str):
                    if item in strings:
                        node[key] = strings[item]  # a value replaced: the dict keeps its size
                elif isinstance(item, list | dict):
                    stack.append(item)
            if renamed:
                items = [(strings.get(key, key), item) for key, item in node.items()]
                node.clear()
                node.update(items)
                if unique and len(node) != len(items):
                    raise ValueError("duplicate key")
    return value


# -- encoding -------------------------------------------------------------------------------------


def heavy(value: Any, budget: int = 1024) -> bool:
    """True when ``value`` may hold more than a :data:`PIECE` of characters, keys included, and
    values: its strings' lengths passed that, or its values ``budget``, before the look ended
    (at most ``budget`` steps of Python: cheap enough for the event loop)."""
    if isinstance(value, str):
        return len(value) > PIECE
    weight = 0
    stack = [value]
    while stack:
        budget -= 1
        if budget < 0:
            return True
        node = stack.pop()
        if isinstance(node, str):
            weight += len(node)
        elif isinstance(node, list):
            stack.extend(node)
            weight += len(node)
        elif isinstance(node, dict):
            for key in node:
                weight += len(key) + 1
            stack.extend(node.values())
        if weight > PIECE:
            return True
    return False


class _Sink:
    """Where :func:`encode` writes: its bytes while they are within ``limit``, then only their
    count."""

    __slots__ = ("data", "length", "limit")

    def __init__(self, limit: int | None) -> None:
        self.data: bytearray | None = bytearray()
        self.length = 0
        self.limit = limit

    def write(self, chunk: bytes | memoryview) -> None:
        self.length += len(chunk)
        if self.data is None:
            return
        if self.limit is not None and self.length > self.limit:
            self.data = None  # it will not be sent: what is kept is only its length
        else:
            self.data += chunk


def encode(value: Any, limit: int | None = None) -> bytearray | int:
    """``value`` as the JSON text one ``msgspec.json.encode`` gives, written by C calls that each
    handle at most about a :data:`PIECE` of characters or values; a loop of Python over its
    containers. Past ``limit`` bytes nothing more is kept: the result is then the text's length
    alone. Encoding fails as one encode would (``TypeError``, ``OverflowError``)."""
    sink = _Sink(limit)
    try:
        _write(value, sink)
    except RecursionError:
        # Nested deeper than Python's recursion goes here (msgspec decodes up to ~1,000 levels,
        # this walk about half): such a value is encoded in one call, as before.
        whole = _ENCODER.encode(value)
        return len(whole) if limit is not None and len(whole) > limit else bytearray(whole)
    return sink.length if sink.data is None else sink.data


def _write(value: Any, sink: _Sink) -> None:
    if isinstance(value, str):
        if len(value) <= PIECE:
            sink.write(_ENCODER.encode(value))
            return
        # A str is cut between code points: no cut falls inside an escape or a UTF-8 sequence.
        sink.write(b'"')
        for start in range(0, len(value), PIECE):
            sink.write(memoryview(_ENCODER.encode(value[start : start + PIECE]))[1:-1])
        sink.write(b'"')
    elif isinstance(value, list):
        _write_items(value, sink, value, b"[", b"]")
    elif isinstance(value, dict):
        _write_items(list(value.items()), sink, value, b"{", b"}")
    else:
        sink.write(_ENCODER.encode(value))


def _write_items(
    items: list[Any], sink: _Sink, container: Any, opening: bytes, closing: bytes
) -> None:
    """The items of ``container`` (a list's values, a dict's key-value pairs): runs of small ones
    in one encode each, large strings and containers each on its own."""
    is_dict = isinstance(container, dict)
    sink.write(opening)
    separator = b""
    start = weight = 0
    for index, item in enumerate(items):
        key, element = item if is_dict else ("", item)
        size = _small_size(element)
        if size is None or len(key) + size > PIECE:
            if index > start:
                sink.write(separator)
                _write_run(items[start:index], sink, is_dict)
                separator = b","
            sink.write(separator)
            if is_dict:
                _write(key, sink)
                sink.write(b":")
            _write(element, sink)
            separator = b","
            start, weight = index + 1, 0
            continue
        if weight + len(key) + size > PIECE and index > start:
            sink.write(separator)
            _write_run(items[start:index], sink, is_dict)
            separator = b","
            start, weight = index, 0
        weight += len(key) + size
    if len(items) > start:
        sink.write(separator)
        _write_run(items[start:], sink, is_dict)
    sink.write(closing)


def _small_size(value: Any) -> int | None:
    """The weight of a string, number, boolean or null; ``None`` for a container."""
    if isinstance(value, str):
        return len(value) + 1
    if isinstance(value, list | dict):
        return None
    return 1


def _write_run(run: list[Any], sink: _Sink, is_dict: bool) -> None:
    """Consecutive small items in one encode, without its brackets."""
    encoded = _ENCODER.encode(dict(run) if is_dict else run)
    sink.write(memoryview(encoded)[1:-1])
