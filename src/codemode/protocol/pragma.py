"""The ``// @exec: {JSON}`` first-line pragma of the exec tool (``protocol-v1.md`` §1.9)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import msgspec

from codemode.errors import CodeModeError
from codemode.protocol.constants import CODE_MODE_PRAGMA_PREFIX, MAX_JS_SAFE_INTEGER, U64_MAX
from codemode.protocol.strict_json import decode_error_detail
from codemode.protocol.whitespace import is_blank, trim, trim_start

__all__ = ["ParsedExecSource", "parse_exec_source"]

_FIELDS: Final = ("yield_time_ms", "max_output_tokens")
_EMPTY_SOURCE: Final = (
    "exec expects raw JavaScript source text (non-empty). Provide JS only, optionally with "
    'first-line `// @exec: {"yield_time_ms": 10000, "max_output_tokens": 1000}`.'
)
_NO_SOURCE: Final = "exec pragma must be followed by JavaScript source on subsequent lines"
_NOT_OBJECT: Final = (
    "exec pragma must be a JSON object with supported fields `yield_time_ms` and "
    "`max_output_tokens`"
)
_INVALID_JSON: Final = (
    "exec pragma must be valid JSON with supported fields `yield_time_ms` and `max_output_tokens`: "
)
_UNKNOWN_KEY: Final = "exec pragma only supports `yield_time_ms` and `max_output_tokens`; got `{}`"
_BAD_VALUE: Final = (
    "exec pragma fields `yield_time_ms` and `max_output_tokens` must be non-negative safe "
    "integers: "
)
_UNSAFE: Final = "exec pragma field `{}` must be a non-negative safe integer"

# Duplicate keys are allowed in a pragma (the last one wins), so plain msgspec decoding fits.
_DECODER: Final = msgspec.json.Decoder()


@dataclass(frozen=True, slots=True)
class ParsedExecSource:
    """JavaScript source with the pragma removed, and the pragma's values (``None`` = absent)."""

    code: str
    yield_time_ms: int | None = None
    max_output_tokens: int | None = None
    #: Lines removed from the top of the input (1 for the pragma line): the engine's line
    #: numbers plus this are the lines the model wrote.
    removed_lines: int = 0


def _describe(value: object) -> str:
    if isinstance(value, bool):
        return f"invalid type: boolean `{str(value).lower()}`, expected u64"
    if isinstance(value, int):
        return f"invalid value: integer `{value}`, expected u64"
    if isinstance(value, float):
        return f"invalid type: floating point `{value!r}`, expected u64"
    if isinstance(value, str):
        return f'invalid type: string "{value}", expected u64'
    kind = "sequence" if isinstance(value, list) else "map"
    return f"invalid type: {kind}, expected u64"


def parse_exec_source(source: str) -> ParsedExecSource:
    """Split an exec input into JavaScript and pragma values, or raise :class:`CodeModeError`."""
    if is_blank(source):
        raise CodeModeError(_EMPTY_SOURCE)
    first, _newline, rest = source.partition("\n")
    if not trim_start(first).startswith(CODE_MODE_PRAGMA_PREFIX):
        return ParsedExecSource(source)
    if is_blank(rest):
        raise CodeModeError(_NO_SOURCE)
    directive = trim(trim_start(first)[len(CODE_MODE_PRAGMA_PREFIX) :])
    if not directive:
        raise CodeModeError(_NOT_OBJECT)
    text = directive.encode("utf-8", "surrogatepass")
    try:
        value = _DECODER.decode(text)
    except msgspec.DecodeError as error:
        raise CodeModeError(_INVALID_JSON + decode_error_detail(error, text)) from None
    except RecursionError:  # nested deeper than the decoder goes (serde_json's words)
        raise CodeModeError(_INVALID_JSON + "recursion limit exceeded") from None
    if not isinstance(value, dict):
        raise CodeModeError(_NOT_OBJECT)
    for key in value:
        if key not in _FIELDS:
            raise CodeModeError(_UNKNOWN_KEY.format(key))
    values: dict[str, int | None] = {}
    for key in _FIELDS:
        item = value.get(key)
        if item is not None and (type(item) is not int or not 0 <= item <= U64_MAX):
            raise CodeModeError(_BAD_VALUE + _describe(item))
        values[key] = item
    for key in _FIELDS:
        item = values[key]
        if item is not None and item > MAX_JS_SAFE_INTEGER:
            raise CodeModeError(_UNSAFE.format(key))
    return ParsedExecSource(
        rest, values["yield_time_ms"], values["max_output_tokens"], removed_lines=1
    )
