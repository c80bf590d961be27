"""The model-facing ``exec`` and ``wait`` tool definitions (``runtime.md`` §14, §15.1, §15.2).

Both are exported in the shapes the OpenAI Responses API accepts: ``exec`` as a custom (freeform)
tool constrained by a Lark grammar, ``wait`` as a JSON function tool.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Final

import msgspec

from codemode.errors import CodeModeError
from codemode.model.typescript import has_mcp_output, normalize_identifier, render_tool_sample
from codemode.protocol.constants import (
    DEFAULT_EXEC_YIELD_TIME_MS,
    DEFAULT_MAX_OUTPUT_TOKENS_PER_EXEC_CALL,
    DEFAULT_WAIT_YIELD_TIME_MS,
    PUBLIC_TOOL_NAME,
    U64_MAX,
    WAIT_TOOL_NAME,
)
from codemode.protocol.strict_json import decode_error_detail
from codemode.protocol.types import JSON, ToolDefinition
from codemode.protocol.whitespace import trim

__all__ = [
    "ARGUMENTS_TOO_DEEP",
    "EXEC_GRAMMAR",
    "SHARED_MCP_TYPES",
    "WAIT_PARAMETERS",
    "NamespaceDescription",
    "WaitArguments",
    "build_exec_description",
    "build_wait_description",
    "exec_tool_spec",
    "parse_wait_arguments",
    "wait_tool_spec",
]

#: The Lark grammar the exec tool's input must match (§14), byte for byte.
EXEC_GRAMMAR: Final = (
    "start: pragma_source | plain_source\n"
    "pragma_source: PRAGMA_LINE NEWLINE SOURCE\n"
    "plain_source: SOURCE\n"
    "PRAGMA_LINE: /[ \\t]*\\/\\/ @exec:[^\\r\\n]*/\n"
    "NEWLINE: /\\r?\\n/\n"
    "SOURCE: /[\\s\\S]+/"
)

_INTRO: Final = """\
Run JavaScript to orchestrate and compose tool calls.
- The code runs in a fresh V8 isolate, evaluated as an async module (top-level `await` works).
- Nested tools are methods of the global `tools` object, for example \
`await tools.exec_command(...)`. Their names are normalized JavaScript identifiers, for example \
`await tools.mcp__ologs__get_profile(...)`.
- A nested tool method takes a string or an object as its input, and returns an object or a \
string, as its description says.
- This is raw JavaScript only: no Node, no file system, no network access, no console.
- Send raw JavaScript source text: not JSON, not a quoted string, not a markdown code fence.
- The input may start with an optional first-line pragma such as \
`// @exec: {"yield_time_ms": 10000, "max_output_tokens": 1000}`.
- `yield_time_ms`: if the script is still running after that many milliseconds, `exec` yields \
early with the output so far. Defaults to {yield_ms} ms.
- `max_output_tokens`: the token budget for direct `exec` results. Defaults to \
{max_tokens} tokens.
- When the module has been evaluated, the isolate ends and unawaited promises are silently \
discarded."""

_NO_CONSOLE: Final = ", no console."

_DETAIL_TYPE: Final = '"auto" | "low" | "high" | "original" | null'
_IMAGE_WITH_DETAIL: Final = (
    "- `image(imageUrlOrItem: string | { image_url: string; detail?: "
    + _DETAIL_TYPE
    + " } | ImageContent, detail?: "
    + _DETAIL_TYPE
    + ")`: appends an image from a base64 `data:` URL. To forward an MCP image, pass one "
    "`ImageContent` block, for example `image(result.content[0])`; such a block may request a "
    'detail with `_meta: { "codex/imageDetail": "original" }`. When given, the second argument '
    "overrides any detail carried by the first."
)
_IMAGE_WITHOUT_DETAIL: Final = (
    "- `image(imageUrlOrItem: string | { image_url: string } | ImageContent)`: appends an image "
    "from a base64 `data:` URL. To forward an MCP image, pass one `ImageContent` block, for "
    "example `image(result.content[0])`."
)
_STORE_LOAD: Final = """\
- `store(key: string, value: any)`: keeps a JSON-serializable value for later `exec` calls in \
this session.
- `load(key: string)`: returns a stored value, or `undefined` when the key is missing."""

_DEFERRED_NOTE: Final = (
    "Some nested tools may be omitted from this description. They are still available on the "
    "global `tools` object and listed in `ALL_TOOLS`. To find one, filter `ALL_TOOLS` by `name` "
    "and `description`; do not print the whole `ALL_TOOLS` array, only the few matches you need."
)

#: TypeScript declarations of the MCP result types (MCP schema, ``CallToolResult``).
SHARED_MCP_TYPES: Final = """\
type Role = "user" | "assistant";
type MetaObject = { [key: string]: unknown };
type Annotations = { audience?: Role[]; priority?: number; lastModified?: string };
type Icon = { src: string; mimeType?: string; sizes?: string[]; theme?: "light" | "dark" };
type TextResourceContents = { uri: string; mimeType?: string; _meta?: MetaObject; text: string };
type BlobResourceContents = { uri: string; mimeType?: string; _meta?: MetaObject; blob: string };
type TextContent = {
  type: "text"; text: string; annotations?: Annotations; _meta?: MetaObject;
};
type ImageContent = {
  type: "image"; data: string; mimeType: string; annotations?: Annotations; _meta?: MetaObject;
};
type AudioContent = {
  type: "audio"; data: string; mimeType: string; annotations?: Annotations; _meta?: MetaObject;
};
type ResourceLink = {
  type: "resource_link"; name: string; title?: string; uri: string; description?: string;
  mimeType?: string; size?: number; icons?: Icon[]; annotations?: Annotations; _meta?: MetaObject;
};
type EmbeddedResource = {
  type: "resource"; resource: TextResourceContents | BlobResourceContents;
  annotations?: Annotations; _meta?: MetaObject;
};
type ContentBlock = TextContent | ImageContent | AudioContent | ResourceLink | EmbeddedResource;
type CallToolResult<TStructured = { [key: string]: unknown }> = {
  _meta?: MetaObject;
  content: ContentBlock[];
  isError?: boolean;
  structuredContent?: TStructured;
  [key: string]: unknown;
};"""


@dataclass(frozen=True, slots=True)
class NamespaceDescription:
    """A namespace's heading (``name``) and the text shown above its tools."""

    name: str
    description: str


def _helpers(store_load: bool, image_detail: bool, console: bool = False) -> str:
    lines = [
        "Global helpers:",
        "- `exit()`: ends the script successfully right away, like an early top-level return.",
        "- `text(value: string | number | boolean | undefined | null)`: appends a text item; "
        "non-string values are stringified with `JSON.stringify(...)`.",
        _IMAGE_WITH_DETAIL if image_detail else _IMAGE_WITHOUT_DETAIL,
        "- `audio(audioUrlOrItem: string | { audio_url: string } | AudioContent)`: appends an "
        "audio clip from a base64 `data:` URL or an MCP `AudioContent` block.",
        "- `generatedImage(result: { image_url: string; output_hint?: string })`: appends an "
        "image generation result from its base64 `data:` URL (HTTP(S) URLs are not supported), "
        "then its `output_hint` as text.",
    ]
    if store_load:
        lines.append(_STORE_LOAD)
    if console:
        lines.append(
            "- `console.log(...values)` (also `info`, `warn`, `error`, `debug`): appends one text "
            "item, the values stringified like `text(...)` and joined by spaces."
        )
    lines += [
        "- `notify(value: string | number | boolean | undefined | null)`: immediately injects an "
        "extra `custom_tool_call_output` for the current `exec` call; the value is stringified "
        "like `text(...)`.",
        "- `setTimeout(callback: () => void, delayMs?: number)`: schedules a callback and "
        "returns a timeout id. Pending timeouts do not keep `exec` alive; await an explicit "
        "promise to wait for one.",
        "- `clearTimeout(timeoutId?: number)`: cancels a timeout created by `setTimeout`.",
        "- `ALL_TOOLS`: metadata of the enabled nested tools as `{ name, description }` entries.",
        "- `yield_control()`: yields the accumulated output immediately while the script keeps "
        "running.",
    ]
    return "\n".join(lines)


# Characters that end or break a markdown line (a model's tokenizer may read NEL and the Unicode
# separators as line breaks too): a raw tool name holding one is written as a JSON string.
_BREAKS_A_LINE: Final = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_BACKTICKS: Final = re.compile("`+")


def _code_span(text: str) -> str:
    """``text`` as a one-line markdown code span that none of its own characters can end."""
    if _BREAKS_A_LINE.search(text):
        quoted = json.dumps(text, ensure_ascii=False)
        text = _BREAKS_A_LINE.sub(lambda match: f"\\u{ord(match.group()):04x}", quoted)
    # CommonMark: a span opened by N backticks is closed only by a run of exactly N.
    fence = "`" * (max((len(run) for run in _BACKTICKS.findall(text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _tool_sections(
    tools: Sequence[ToolDefinition], namespaces: Mapping[str, NamespaceDescription]
) -> list[str]:
    sections: list[str] = []
    current: str | None = None
    for tool in tools:
        namespace = tool.tool_name.namespace
        registered = namespaces.get(namespace) if namespace is not None else None
        group = registered.name if registered is not None else None
        if group != current:
            current = group
            if registered is not None and trim(registered.description):
                sections.append(f"## {registered.name}\n{trim(registered.description)}")
        global_name = normalize_identifier(tool.name)
        heading = f"### `{global_name}`"
        if global_name != tool.name:
            # The raw name comes from the tool's provider: it must not end the heading (and
            # start a section of its own) or close its code span early.
            heading += f" ({_code_span(tool.name)})"
        sample = trim(render_tool_sample(tool))
        sections.append(f"{heading}\n{sample}" if sample else heading)
    return sections


def build_exec_description(
    enabled_tools: Sequence[ToolDefinition] = (),
    *,
    code_mode_only: bool = False,
    deferred_tools: Sequence[ToolDefinition] = (),
    namespace_descriptions: Mapping[str, NamespaceDescription] | None = None,
    store_load: bool = True,
    image_detail: bool = True,
    default_yield_time_ms: int = DEFAULT_EXEC_YIELD_TIME_MS,
    console: bool = False,
) -> str:
    """The ``exec`` tool description (§15.1).

    ``code_mode_only``: nested tools are reachable only through exec, so their declarations are
    listed here; ``deferred_tools``: tools on ``tools``/``ALL_TOOLS`` but not described;
    ``namespace_descriptions`` is keyed by ``ToolName.namespace``.
    """
    intro = _INTRO.replace("{yield_ms}", str(default_yield_time_ms)).replace(
        "{max_tokens}", str(DEFAULT_MAX_OUTPUT_TOKENS_PER_EXEC_CALL)
    )
    if console:
        # §15.1 item 5 says "no console" for the reference runtime's cells; this one has one,
        # documented among the helpers below.
        intro = intro.replace(_NO_CONSOLE, ".")
    sections = [intro, _helpers(store_load, image_detail, console)]
    if deferred_tools:
        sections.append(_DEFERRED_NOTE)
    if code_mode_only:
        if has_mcp_output([*enabled_tools, *deferred_tools]):
            sections.append(f"Shared MCP Types:\n```ts\n{SHARED_MCP_TYPES}\n```")
        tool_sections = _tool_sections(enabled_tools, namespace_descriptions or {})
        if tool_sections:
            sections.append("\n\n".join(tool_sections))
    return "\n\n".join(sections)


def exec_tool_spec(description: str) -> dict[str, JSON]:
    """The exec tool as a Responses API custom tool with the Lark grammar."""
    return {
        "type": "custom",
        "name": PUBLIC_TOOL_NAME,
        "description": description,
        "format": {"type": "grammar", "syntax": "lark", "definition": EXEC_GRAMMAR},
    }


def _wait_parameters() -> dict[str, JSON]:
    return {
        "type": "object",
        "properties": {
            "cell_id": {"type": "string", "description": "Identifier of the running exec cell."},
            "yield_time_ms": {
                "type": "number",
                "description": "Wait before yielding more output. Defaults to 10000 ms.",
            },
            "max_tokens": {
                "type": "number",
                "description": "Output token budget for this wait call. Defaults to 10000 tokens.",
            },
            "terminate": {
                "type": "boolean",
                "description": (
                    "True stops the running exec cell; false or omitted waits for output."
                ),
            },
        },
        "required": ["cell_id"],
        "additionalProperties": False,
    }


#: The wait tool's JSON Schema parameters (§15.2); use :func:`wait_tool_spec` for a fresh copy.
WAIT_PARAMETERS: Final = _wait_parameters()


def build_wait_description(
    default_yield_time_ms: int = DEFAULT_WAIT_YIELD_TIME_MS,
    default_max_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS_PER_EXEC_CALL,
) -> str:
    """The ``wait`` tool description (§15.2)."""
    return (
        "Waits on a yielded `exec` cell and returns new output or completion.\n"
        "- Use `wait` only after `exec` returned `Script running with cell ID ...`.\n"
        "- `cell_id` identifies the running `exec` cell.\n"
        "- `yield_time_ms` is how long to wait for more output before yielding again "
        f"(default {default_yield_time_ms} ms).\n"
        "- `max_tokens` limits how much new output this call returns "
        f"(default {default_max_tokens} tokens).\n"
        "- `terminate: true` stops the running cell instead of waiting.\n"
        "- `wait` returns only the output produced since the last yield, or the final "
        "completion or termination result of the cell.\n"
        "- While the cell keeps running, `wait` may yield again with the same `cell_id`.\n"
        "- If the cell has already finished, `wait` returns its completed result and closes it."
    )


def wait_tool_spec(description: str | None = None) -> dict[str, JSON]:
    """The wait tool as a Responses API function tool (``strict: false``)."""
    return {
        "type": "function",
        "name": WAIT_TOOL_NAME,
        "description": build_wait_description() if description is None else description,
        "parameters": _wait_parameters(),
        "strict": False,
    }


#: Function arguments (of ``wait``, or of ``exec`` as a function tool) nested deeper than the
#: JSON decoder goes.
ARGUMENTS_TOO_DEEP: Final = "failed to parse function arguments: JSON nested too deeply"

# msgspec cannot bound beyond int64, so the u64 ceiling is checked in __post_init__.
_NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class WaitArguments(msgspec.Struct, frozen=True):
    """Decoded ``wait`` arguments; unknown keys are ignored (§15.2 decision)."""

    cell_id: str
    yield_time_ms: _NonNegative | None = None
    max_tokens: _NonNegative | None = None
    terminate: bool | None = None

    def __post_init__(self) -> None:
        for name in ("yield_time_ms", "max_tokens"):
            value = getattr(self, name)
            if value is not None and value > U64_MAX:
                raise ValueError(f"invalid value: integer `{value}` for `{name}`, expected u64")

    @property
    def effective_yield_time_ms(self) -> int:
        """``yield_time_ms`` or the default wait yield time."""
        return DEFAULT_WAIT_YIELD_TIME_MS if self.yield_time_ms is None else self.yield_time_ms

    @property
    def effective_max_tokens(self) -> int:
        """``max_tokens`` or the default output budget."""
        if self.max_tokens is None:
            return DEFAULT_MAX_OUTPUT_TOKENS_PER_EXEC_CALL
        return self.max_tokens


_WAIT_DECODER: Final = msgspec.json.Decoder(WaitArguments)


def parse_wait_arguments(arguments: str | bytes | Mapping[str, object]) -> WaitArguments:
    """Decode the wait tool's JSON arguments (the text, or a mapping a client library already
    decoded) or raise ``failed to parse function arguments: …``."""
    try:
        if isinstance(arguments, Mapping):
            return msgspec.convert(dict(arguments), WaitArguments)
        return _WAIT_DECODER.decode(arguments)
    except msgspec.DecodeError as error:
        text = "" if isinstance(arguments, Mapping) else arguments
        detail = decode_error_detail(error, text)
        raise CodeModeError(f"failed to parse function arguments: {detail}") from None
    except UnicodeError as error:
        raise CodeModeError(f"failed to parse function arguments: {error}") from None
    except RecursionError:  # the model's JSON nests deeper than the decoder goes
        raise CodeModeError(ARGUMENTS_TOO_DEEP) from None
