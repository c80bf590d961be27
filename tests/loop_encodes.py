"""What the event loop's thread encodes: the check behind every "encoded off the loop" test.

msgspec holds the GIL through one call, so a long encode holds the event loop whichever thread
makes it; the runtime and the hosts make large ones on worker threads, a piece at a time. A test
swaps a module's ``_ENCODER`` for a watched one (:func:`watch_encoders`) and asserts on what the
loop's thread encoded: the size of each output and the longest string a message held (an
already encoded ``msgspec.Raw`` holds none). Never a timing.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import msgspec
import pytest

__all__ = ["LoopEncodes", "longest_string", "watch_decoders", "watch_encoders"]


@dataclass
class LoopEncodes:
    """What the thread that set the watch up (the event loop's) encoded."""

    thread: int = field(default_factory=threading.get_ident)
    sizes: list[int] = field(default_factory=list)  # the size of each output
    longest: int = 0  # the longest string of any message


def longest_string(value: Any) -> int:
    """The longest string ``value`` holds, keys included (a ``msgspec.Raw`` holds none)."""
    longest = 0
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, str):
            longest = max(longest, len(node))
        elif isinstance(node, list | tuple):
            stack.extend(node)
        elif isinstance(node, dict):
            stack.extend(node)
            stack.extend(node.values())
        elif isinstance(node, msgspec.Struct):
            stack.extend(getattr(node, name) for name in node.__struct_fields__)
    return longest


class _Watched:
    def __init__(self, encoder: Any, record: LoopEncodes) -> None:
        self._encoder = encoder
        self._record = record

    def _note(self, message: Any, size: int) -> None:
        record = self._record
        if threading.get_ident() == record.thread:
            record.sizes.append(size)
            record.longest = max(record.longest, longest_string(message))

    def encode(self, message: Any) -> bytes:
        out: bytes = self._encoder.encode(message)
        self._note(message, len(out))
        return out

    def encode_into(self, message: Any, buffer: bytearray, offset: int = 0) -> None:
        self._encoder.encode_into(message, buffer, offset)
        self._note(message, len(buffer) - offset)


def watch_encoders(monkeypatch: pytest.MonkeyPatch, *modules: ModuleType) -> LoopEncodes:
    """Watch the ``_ENCODER`` of each of ``modules``; one record for all of them."""
    record = LoopEncodes()
    for module in modules:
        monkeypatch.setattr(module, "_ENCODER", _Watched(module._ENCODER, record))
    return record


class _WatchedDecoder:
    def __init__(self, decoder: Any, sizes: list[int]) -> None:
        self._decoder = decoder
        self._sizes = sizes

    def decode(self, data: Any) -> Any:
        self._sizes.append(len(data))
        return self._decoder.decode(data)


def watch_decoders(monkeypatch: pytest.MonkeyPatch, *decoders: tuple[ModuleType, str]) -> list[int]:
    """Watch each ``(module, name)`` decoder; the size of every input they decode, on any
    thread (msgspec holds the GIL through one call: off the loop or not, none may be long)."""
    sizes: list[int] = []
    for module, name in decoders:
        monkeypatch.setattr(module, name, _WatchedDecoder(getattr(module, name), sizes))
    return sizes
