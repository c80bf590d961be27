"""Strict JSON as every V1 payload must be (``protocol-v1.md`` §2.1).

msgspec already rejects bad UTF-8, a byte-order mark, trailing data, ``NaN``/``Infinity``, numbers
that overflow a double and lone surrogate escapes. The one rule it does not check is "no object has
the same key twice", so this module adds that check without a second parse in the common case:

A key is always followed by one ``:`` outside any string; every other ``:`` in the text sits inside a
string, written literally or as an escape (``\\u003a``). Re-encoding the decoded value writes every
key once and every string's colons literally, so the source's colons and colon escapes together
number exactly the re-encoding's colons unless a duplicate key collapsed. Only then is the text
parsed again, slowly (by jiter for a large text), to find the duplicate.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import re
from collections.abc import Iterator
from typing import Any, Final

import jiter
import msgspec

__all__ = [
    "LARGE_PAYLOAD_BYTES",
    "JSONError",
    "check_no_duplicate_keys",
    "collector_paused",
    "decode_error_detail",
    "dumps",
    "loads",
    "loads_large",
    "non_finite_number",
]

#: From this size on, texts are parsed by jiter, which checks duplicate keys while parsing.
LARGE_PAYLOAD_BYTES: Final = 256 * 1024

_ANY_DECODER: Final = msgspec.json.Decoder()
_ENCODER: Final = msgspec.json.Encoder()
_MSGPACK: Final = msgspec.msgpack.Encoder()
# msgspec writes every float as a MessagePack float 64: 0xcb, then its 8 bytes big-endian. A NaN or
# an infinity has every exponent bit set: its first byte is 0x7f or 0xff, its second 0xf0 or
# above. So this finds every non-finite float of a packed value. It may also match elsewhere (an
# integer's or another float's bytes, a string length of 203 before a string that starts so;
# never inside UTF-8 text, where 0xcb must be followed by 0x80-0xbf): a rare false alarm, which the
# exact walk then clears.
_NON_FINITE_FLOAT64: Final = re.compile(rb"\xcb[\x7f\xff][\xf0-\xff]")

# A colon written as an escape (``\\u003a``), its backslash not itself escaped.
_ESCAPED_COLON: Final = re.compile(rb"(?<!\\)(?:\\\\)*\\u003[aA]")
# A high surrogate escape not followed by a low one, its backslash not itself escaped.
_UNPAIRED_HIGH_SURROGATE: Final = re.compile(
    rb"(?<!\\)(?:\\\\)*(\\u[dD][89abAB][0-9a-fA-F]{2})(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
)

Buffer = bytes | bytearray | memoryview


class JSONError(ValueError):
    """A payload is not strict JSON; ``str()`` is the detail."""


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise JSONError(f"duplicate key `{key}` in a JSON object")
            seen.add(key)
    return result


def _find_duplicate_slowly(text: bytes) -> None:
    try:
        json.loads(text, object_pairs_hook=_reject_duplicates)
    except JSONError:
        raise
    except ValueError as error:  # e.g. an integer beyond Python's digit limit
        raise JSONError(str(error)) from None


def check_no_duplicate_keys(
    text: bytes | bytearray, decoded: Any, encoded: bytes | None = None
) -> None:
    """Raise :class:`JSONError` if ``text`` (already decoded as ``decoded``) repeats a key.

    ``decoded`` may be any msgspec-encodable value decoded from exactly that text, typed or not
    (a typed value must not write a key its text lacked); ``encoded`` is its canonical encoding,
    when the caller already made it.
    """
    try:
        if encoded is None:
            encoded = _ENCODER.encode(decoded)
    except (TypeError, ValueError, OverflowError):
        pass
    else:
        colons = text.count(b":")
        if text.find(b"\\u003") != -1:
            # A colon spelled as an escape is written literally by the encoder.
            colons += len(_ESCAPED_COLON.findall(text))
        if colons == encoded.count(b":"):
            return
    if len(text) >= LARGE_PAYLOAD_BYTES:
        loads_large(bytes(text))  # a parse in Python would take seconds
        return
    _find_duplicate_slowly(bytes(text))


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic collector off for the block, as it was after it: a decode that makes
    millions of lists and dicts would otherwise have it walk them again and again."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def loads_large(data: bytes) -> Any:
    """Decode a strict JSON text with jiter (fast on long strings).

    The cyclic collector is paused meanwhile: run while a decode makes millions of lists and
    dicts, it walked them again and again (most of the time of such a text: 0.9 s for two
    million empty arrays)."""
    try:
        with collector_paused():
            value = jiter.from_json(
                data, allow_inf_nan=False, catch_duplicate_keys=True, cache_mode="keys"
            )
    except ValueError as error:
        raise JSONError(str(error)) from None
    # jiter turns a number beyond the double range into inf; strict JSON rejects it. Found at C
    # speed (a walk over every value in Python took 0.5 s for four million numbers).
    if non_finite_number(value) is not None:
        raise JSONError("number out of range")
    return value


def non_finite_number(value: Any) -> float | None:
    """A NaN or infinite float inside ``value``, if any (msgspec would write it as ``null``).

    Callers that already encoded ``value`` only need this when the encoding contains ``null``.
    """
    try:
        packed = _MSGPACK.encode(value)
    except (TypeError, ValueError, OverflowError):
        pass  # not encodable as it is: the walk below decides
    else:
        if _NON_FINITE_FLOAT64.search(packed) is None:
            return None  # the common case, at C speed: no walk over a large value in Python
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is float:
            if not math.isfinite(item):
                return item  # type: ignore[no-any-return]
        elif kind is dict:
            stack.extend(item.values())
        elif kind is list or kind is tuple:
            stack.extend(item)
    return None


def decode_error_detail(error: msgspec.DecodeError, data: Buffer | str) -> str:
    """msgspec's detail for ``error``, made true where it misleads.

    msgspec reports a high surrogate escape with fewer than six bytes after it (``"\\ud800"}``)
    as "Input data was truncated", which sends a reader looking for a cut-off text.
    """
    detail = str(error)
    if detail == "Input data was truncated":
        text = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
        found = _UNPAIRED_HIGH_SURROGATE.search(text)
        if found is not None:
            return f"JSON is malformed: unpaired utf-16 surrogate escape (byte {found.start(1)})"
    return detail


def loads(data: Buffer | str) -> Any:
    """Decode one strict JSON text (bytes or str) into plain Python values."""
    if isinstance(data, str):
        try:
            raw: bytes | bytearray = data.encode("utf-8")
        except UnicodeEncodeError as error:
            raise JSONError(f"invalid Unicode text: {error.reason}") from None
    elif isinstance(data, memoryview):
        raw = data.tobytes()
    else:
        raw = data
    if len(raw) >= LARGE_PAYLOAD_BYTES:
        return loads_large(bytes(raw))
    try:
        value = _ANY_DECODER.decode(raw)
    except msgspec.DecodeError as error:
        raise JSONError(decode_error_detail(error, raw)) from None
    check_no_duplicate_keys(raw, value)
    return value


def dumps(value: Any) -> bytes:
    """Encode canonically: compact, raw UTF-8, keys in insertion order."""
    return _ENCODER.encode(value)
