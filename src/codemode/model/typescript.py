"""JSON Schema → TypeScript declarations for nested tools (``runtime.md`` §15.6).

The renderer is deliberately bounded: schemas come from arbitrary tool providers (MCP servers), so
reference expansion is capped per path and in total, every piece of output is charged against a
work budget, and an oversized result collapses to ``unknown`` instead of flooding the model's
context.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final
from urllib.parse import unquote

import msgspec

from codemode.protocol.identifiers import normalize_identifier
from codemode.protocol.types import JSON, CodeModeToolKind, ToolDefinition
from codemode.protocol.whitespace import trim

__all__ = [
    "MAX_REF_EXPANSIONS_PER_PATH",
    "MAX_REF_EXPANSIONS_TOTAL",
    "MAX_RENDERED_BYTES",
    "WORK_BUDGET_BYTES",
    "has_mcp_output",
    "mcp_structured_content_schema",
    "normalize_identifier",
    "render_json_schema",
    "render_tool_declaration",
    "render_tool_sample",
]

MAX_REF_EXPANSIONS_PER_PATH: Final = 2
MAX_REF_EXPANSIONS_TOTAL: Final = 32
MAX_RENDERED_BYTES: Final = 16_000
WORK_BUDGET_BYTES: Final = 64_000

_UNKNOWN: Final = "unknown"
# Keywords that make the object holding a `$ref` render something besides the reference.
_SIBLING_KEYWORDS: Final = (
    "const",
    "enum",
    "anyOf",
    "oneOf",
    "allOf",
    "type",
    "properties",
    "additionalProperties",
    "required",
    "items",
    "prefixItems",
)
_BAD_POINTER_ESCAPE: Final = re.compile(r"~(?![01])")
_ARRAY_INDEX: Final = re.compile(r"0|[1-9][0-9]*")
# Every character that ends a `//` comment in JavaScript/TypeScript, not only `\n`: a
# description line must not carry the rest of itself out of its comment into the type.
_LINE_TERMINATORS: Final = re.compile("[\n\r\u2028\u2029]")
_ENCODER: Final = msgspec.json.Encoder()
_MISSING: Final = object()


def _utf8_len(text: str) -> int:
    if text.isascii():
        return len(text)
    return len(text.encode("utf-8", "surrogatepass"))


def _json_text(value: JSON) -> str:
    """Compact JSON with raw non-ASCII characters, as serde_json writes it."""
    try:
        return _ENCODER.encode(value).decode("utf-8")
    except (TypeError, ValueError, OverflowError, UnicodeError):
        import json

        return json.dumps(value, separators=(",", ":"))


class _BudgetExhausted(Exception):
    """The work budget ran out somewhere; the whole rendering becomes ``unknown``."""


def _literal_bound(value: JSON, limit: int) -> int:
    """An upper bound of ``value``'s serialized size; stops early once it exceeds ``limit``."""
    if value is None or value is True:
        return 4
    if value is False:
        return 5
    if isinstance(value, float):
        return len(repr(value))
    if isinstance(value, int):
        # str() of a gigantic int is slow (and refused past 4300 digits): bound it by bits.
        return len(str(value)) if value.bit_length() < 4096 else limit + 1
    if isinstance(value, str):
        return 6 * _utf8_len(value) + 2
    total = 2
    if isinstance(value, list):
        for item in value:
            total += 1 + _literal_bound(item, limit - total)
            if total > limit:
                return total
        return total
    if isinstance(value, dict):
        for key, item in value.items():
            total += 4 + 6 * _utf8_len(str(key))
            if total > limit:
                return total
            total += _literal_bound(item, limit - total)
            if total > limit:
                return total
        return total
    return 4


class _Renderer:
    """One rendering: the root document, the expansion counters and the remaining budget."""

    __slots__ = ("_active", "_budget", "_expansions", "_root")

    def __init__(self, root: JSON) -> None:
        self._root = root
        self._budget = WORK_BUDGET_BYTES
        self._expansions = 0
        # Pointers being expanded on the current path, with how often each is nested.
        self._active: dict[tuple[str, ...], int] = {}

    def _charge(self, text: str) -> str:
        self._budget -= _utf8_len(text)
        if self._budget < 0:
            raise _BudgetExhausted
        return text

    def _literal(self, value: JSON) -> str:
        # Refuse before serializing: a huge `const` must not be materialized at all.
        if _literal_bound(value, self._budget) > self._budget:
            raise _BudgetExhausted
        return _json_text(value)

    def render(self, schema: JSON, scoped: bool) -> str:
        """Render one (sub-)schema; ``scoped`` = inside a sub-schema with its own ``$id``."""
        if schema is True:
            return self._charge(_UNKNOWN)
        if schema is False:
            return self._charge("never")
        if not isinstance(schema, dict):
            return self._charge(_UNKNOWN)
        if "$id" in schema and schema is not self._root:
            scoped = True
        if "$ref" in schema:
            return self._charge(self._with_ref(schema, scoped))
        return self._charge(self._plain(schema, scoped))

    def _with_ref(self, schema: dict[str, JSON], scoped: bool) -> str:
        referenced = self._expand(schema["$ref"], scoped)
        if not any(key in schema for key in _SIBLING_KEYWORDS):
            return referenced
        siblings = self._plain(schema, scoped)
        if referenced == _UNKNOWN:
            return siblings
        if siblings == _UNKNOWN:
            return referenced
        return f"({referenced}) & ({siblings})"

    def _expand(self, ref: JSON, scoped: bool) -> str:
        if scoped or not isinstance(ref, str):
            return _UNKNOWN
        pointer = _parse_local_ref(ref)
        if pointer is None:
            return _UNKNOWN
        target, target_scoped = self._resolve(pointer)
        if target is _MISSING:
            return _UNKNOWN  # dangling refs do not consume the total
        depth = self._active.get(pointer, 0)
        if depth >= MAX_REF_EXPANSIONS_PER_PATH or self._expansions >= MAX_REF_EXPANSIONS_TOTAL:
            return _UNKNOWN
        self._expansions += 1
        self._active[pointer] = depth + 1
        try:
            return self.render(target, target_scoped)
        finally:
            if depth:
                self._active[pointer] = depth
            else:
                del self._active[pointer]

    def _resolve(self, pointer: tuple[str, ...]) -> tuple[JSON, bool]:
        """Follow ``pointer`` from the root; also report whether a ``$id`` lies on the way."""
        node: JSON = self._root
        scoped = False
        last = len(pointer) - 1
        for position, token in enumerate(pointer):
            if isinstance(node, dict):
                if token not in node:
                    return _MISSING, False
                node = node[token]
            elif isinstance(node, list) and _ARRAY_INDEX.fullmatch(token):
                index = int(token)
                if index >= len(node):
                    return _MISSING, False
                node = node[index]
            else:
                return _MISSING, False
            # The target itself is handled by render(); only enclosing sub-schemas count here.
            if position < last and isinstance(node, dict) and "$id" in node:
                scoped = True
        return node, scoped

    def _plain(self, schema: dict[str, JSON], scoped: bool) -> str:
        """Render the keywords of ``schema`` other than ``$ref``."""
        if "const" in schema:
            return self._literal(schema["const"])
        values = schema.get("enum")
        if isinstance(values, list) and values:
            return " | ".join(self._charge(self._literal(value)) for value in values)
        for keyword in ("anyOf", "oneOf"):
            variants = schema.get(keyword)
            if isinstance(variants, list) and variants:
                return " | ".join(self.render(variant, scoped) for variant in variants)
        parts = schema.get("allOf")
        if isinstance(parts, list) and parts:
            rendered = (self.render(part, scoped) for part in parts)
            return " & ".join(f"({part})" if " | " in part else part for part in rendered)
        schema_type = schema.get("type", _MISSING)
        if isinstance(schema_type, list):
            keywords = [self._keyword(schema, entry, scoped) for entry in schema_type]
            names = [keyword for keyword in keywords if keyword is not None]
            if names:
                return " | ".join(names)
        elif isinstance(schema_type, str):
            return self._keyword(schema, schema_type, scoped) or _UNKNOWN
        if "properties" in schema or "additionalProperties" in schema or "required" in schema:
            return self._object(schema, scoped)
        if "items" in schema or "prefixItems" in schema:
            return self._array(schema, scoped)
        return _UNKNOWN

    def _keyword(self, schema: dict[str, JSON], name: JSON, scoped: bool) -> str | None:
        if not isinstance(name, str):
            return None  # non-string entries of a `type` array are skipped
        if name == "string":
            return "string"
        if name in ("number", "integer"):
            return "number"
        if name == "boolean":
            return "boolean"
        if name == "null":
            return "null"
        if name == "array":
            return self._array(schema, scoped)
        if name == "object":
            return self._object(schema, scoped)
        return _UNKNOWN

    def _array(self, schema: dict[str, JSON], scoped: bool) -> str:
        if "items" in schema:
            return f"Array<{self.render(schema['items'], scoped)}>"
        prefix = schema.get("prefixItems")
        if isinstance(prefix, list) and prefix:
            return "[" + ", ".join(self.render(item, scoped) for item in prefix) + "]"
        return "unknown[]"

    def _object(self, schema: dict[str, JSON], scoped: bool) -> str:
        raw_properties = schema.get("properties")
        properties: dict[str, JSON] = raw_properties if isinstance(raw_properties, dict) else {}
        raw_required = schema.get("required")
        required = (
            {name for name in raw_required if isinstance(name, str)}
            if isinstance(raw_required, list)
            else set()
        )
        multiline = any(_has_description(value) for value in properties.values())
        indent = "  " if multiline else ""
        lines: list[str] = []
        for name in sorted(properties):
            value = properties[name]
            if multiline and isinstance(value, dict):
                description = value.get("description")
                if isinstance(description, str):
                    for raw_line in _LINE_TERMINATORS.split(description):
                        line = trim(raw_line)
                        if line:
                            lines.append(self._charge(f"  // {line}"))
            optional = "" if name in required else "?"
            rendered = self.render(value, scoped)
            lines.append(self._charge(f"{indent}{_property_name(name)}{optional}: {rendered};"))
        extra = schema.get("additionalProperties", _MISSING)
        index_type: str | None
        if extra is _MISSING:
            index_type = None if properties else _UNKNOWN
        elif extra is True:
            index_type = _UNKNOWN
        elif extra is False:
            index_type = None
        else:
            index_type = self.render(extra, scoped)
        if index_type is not None:
            lines.append(self._charge(f"{indent}[key: string]: {index_type};"))
        if multiline:
            return "\n".join(["{", *lines, "}"])
        if not lines:
            return "{}"
        return "{ " + " ".join(lines) + " }"


def _has_description(schema: JSON) -> bool:
    if not isinstance(schema, dict):
        return False
    description = schema.get("description")
    return isinstance(description, str) and bool(description)


def _property_name(name: str) -> str:
    return name if normalize_identifier(name) == name else _json_text(name)


def _parse_local_ref(ref: str) -> tuple[str, ...] | None:
    """Decode ``#/a/b~1c`` into pointer tokens; ``None`` for non-local or malformed refs."""
    if not ref.startswith("#"):
        return None
    try:
        fragment = unquote(ref[1:], errors="strict")
    except UnicodeDecodeError:
        return None
    if not fragment:
        return ()
    if not fragment.startswith("/") or _BAD_POINTER_ESCAPE.search(fragment):
        return None
    return tuple(token.replace("~1", "/").replace("~0", "~") for token in fragment[1:].split("/"))


def render_json_schema(schema: JSON) -> str:
    """Render ``schema`` as a TypeScript type, or ``unknown`` when it exceeds the bounds."""
    try:
        rendered = _Renderer(schema).render(schema, scoped=False)
    except (_BudgetExhausted, RecursionError):
        # RecursionError: absurdly deep schemas are treated like exhausted ones.
        return _UNKNOWN
    if _utf8_len(rendered) > MAX_RENDERED_BYTES:
        return _UNKNOWN
    return rendered


def _is_typed(schema: JSON, type_name: str) -> bool:
    return isinstance(schema, dict) and schema.get("type") == type_name


def mcp_structured_content_schema(output_schema: JSON) -> JSON | None:
    """For an MCP ``CallToolResult``-shaped output schema, its ``structuredContent`` schema.

    Returns ``None`` when the schema is not MCP-shaped, ``True`` when it is MCP-shaped but has no
    ``structuredContent`` property.
    """
    if not isinstance(output_schema, dict):
        return None
    properties = output_schema.get("properties")
    if not isinstance(properties, dict):
        return None
    content = properties.get("content")
    if not isinstance(content, dict) or not _is_typed(content, "array"):
        return None
    if not _is_typed(content.get("items"), "object"):
        return None
    if not _is_typed(properties.get("isError"), "boolean"):
        return None
    if not _is_typed(properties.get("_meta"), "object"):
        return None
    return properties.get("structuredContent", True)


def render_tool_declaration(definition: ToolDefinition) -> str:
    """``name(args: IN): Promise<OUT>;`` for one nested tool."""
    if definition.kind is CodeModeToolKind.FREEFORM:
        parameter, input_type = "input", "string"
    else:
        parameter = "args"
        schema = definition.input_schema
        input_type = _UNKNOWN if schema is None else render_json_schema(schema)
    structured = mcp_structured_content_schema(definition.output_schema)
    if structured is not None:
        rendered = render_json_schema(structured)
        output_type = "CallToolResult" if rendered == _UNKNOWN else f"CallToolResult<{rendered}>"
    elif definition.output_schema is None:
        output_type = _UNKNOWN
    else:
        output_type = render_json_schema(definition.output_schema)
    name = normalize_identifier(definition.name)
    return f"{name}({parameter}: {input_type}): Promise<{output_type}>;"


def render_tool_sample(definition: ToolDefinition) -> str:
    """The tool's description followed by its ``declare const tools`` block (§15.6)."""
    declaration = render_tool_declaration(definition)
    return (
        f"{definition.description}\n\nexec tool declaration:\n```ts\n"
        f"declare const tools: {{ {declaration} }};\n```"
    )


def has_mcp_output(definitions: Iterable[ToolDefinition]) -> bool:
    """True when any definition has an MCP-shaped output schema."""
    return any(mcp_structured_content_schema(d.output_schema) is not None for d in definitions)
