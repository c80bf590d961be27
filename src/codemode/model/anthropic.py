"""The ``exec`` and ``wait`` tools in the Anthropic Messages shape, over :class:`CodeMode`.

Anthropic tools are JSON tools (``name``, ``description``, ``input_schema``), so ``exec`` takes the
JavaScript source in its one string input ``code``. The model calls them with ``tool_use`` content
blocks; each is answered by a ``tool_result`` block (text and ``image`` blocks, ``is_error`` when
the script failed), all of one turn together in the next user message::

    anthropic_tools = code_mode.anthropic
    message = await client.messages.create(model=..., max_tokens=...,
                                           messages=messages, tools=anthropic_tools.tools())
    messages.append({"role": "assistant", "content": message.content})
    calls = [block for block in message.content if anthropic_tools.handles(block)]
    results = await anthropic_tools.handle_all(calls)
    messages.append({"role": "user", "content": results})

Images from base64 ``data:`` URLs become base64 image sources, ``http(s)`` URLs URL sources;
an image Anthropic cannot take (another media type or URL scheme) and audio become a text
placeholder.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Final

from codemode.model.codemode import _field, _text_field, exec_code_parameters
from codemode.model.exec_tool import WAIT_PARAMETERS
from codemode.model.handler import FunctionToolArguments
from codemode.model.render import RenderedOutput
from codemode.protocol.constants import PUBLIC_TOOL_NAME, WAIT_TOOL_NAME
from codemode.protocol.types import JSON, InputImage, InputText

if TYPE_CHECKING:
    from codemode.model.codemode import CodeMode

__all__ = [
    "AUDIO_PLACEHOLDER",
    "IMAGE_MEDIA_TYPES",
    "AnthropicMessages",
    "image_block",
    "tool_result",
]

_NAMES: Final = (PUBLIC_TOOL_NAME, WAIT_TOOL_NAME)

#: The media types of a base64 image source the Messages API accepts.
IMAGE_MEDIA_TYPES: Final = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})

#: What an audio item becomes: a tool result carries no audio.
AUDIO_PLACEHOLDER: Final = "[audio omitted: an Anthropic tool result carries no audio]"


def image_block(image_url: str) -> dict[str, JSON] | None:
    """An ``image`` content block for a base64 ``data:`` URL of a supported media type or an
    ``http(s)`` URL; ``None`` for anything else."""
    scheme, colon, rest = image_url.partition(":")
    scheme = scheme.lower()
    if colon and scheme in ("http", "https"):
        return {"type": "image", "source": {"type": "url", "url": image_url}}
    if not colon or scheme != "data":
        return None
    header, comma, payload = rest.partition(",")
    media_type, _, encoding = header.partition(";")
    media_type = media_type.strip().lower()
    if not comma or encoding.strip().lower() != "base64" or media_type not in IMAGE_MEDIA_TYPES:
        return None
    return {
        "type": "image",
        "source": {"type": "base64", "media_type": media_type, "data": payload},
    }


def tool_result(tool_use_id: str, rendered: RenderedOutput) -> dict[str, JSON]:
    """The ``tool_result`` block answering ``tool_use_id`` with ``rendered``.

    Empty texts are left out (the API rejects empty text blocks); a failed script sets
    ``is_error``.
    """
    content: list[JSON] = []
    for item in rendered.items:
        if isinstance(item, InputText):
            if item.text:
                content.append({"type": "text", "text": item.text})
        elif isinstance(item, InputImage):
            block = image_block(item.image_url)
            if block is None:
                scheme = item.image_url.partition(",")[0][:40]
                block = {"type": "text", "text": f"[image omitted: unsupported source {scheme}]"}
            content.append(block)
        else:
            content.append({"type": "text", "text": AUDIO_PLACEHOLDER})
    result: dict[str, JSON] = {"type": "tool_result", "tool_use_id": tool_use_id}
    result["content"] = content
    if not rendered.success:
        result["is_error"] = True
    return result


class AnthropicMessages:
    """The Anthropic Messages face of a :class:`CodeMode` (get it as ``code_mode.anthropic``)."""

    def __init__(self, code_mode: CodeMode) -> None:
        self.code_mode = code_mode

    def tools(self) -> list[dict[str, JSON]]:
        """``exec`` (source in ``code``) and ``wait`` as Anthropic tool definitions."""
        return [
            {
                "name": PUBLIC_TOOL_NAME,
                "description": self.code_mode.exec_function_description(),
                "input_schema": exec_code_parameters(),
            },
            {
                "name": WAIT_TOOL_NAME,
                "description": self.code_mode.wait_description(),
                "input_schema": copy.deepcopy(WAIT_PARAMETERS),
            },
        ]

    @staticmethod
    def handles(block: object) -> bool:
        """True for a ``tool_use`` content block (mapping or SDK object) of ``exec``/``wait``."""
        return _field(block, "type") == "tool_use" and _field(block, "name") in _NAMES

    async def handle(self, block: object) -> dict[str, JSON]:
        """Run one ``exec``/``wait`` ``tool_use`` block and return its ``tool_result`` block.

        Raises :class:`ValueError` for a block :meth:`handles` does not claim or without a
        string ``id`` (a programming error, not the model's).
        """
        if not self.handles(block):
            raise ValueError("not an Anthropic exec or wait tool_use block")
        tool_use_id = _text_field(block, "id")
        arguments = _field(block, "input")
        code_mode = self.code_mode
        if _field(block, "name") == PUBLIC_TOOL_NAME:
            rendered = await code_mode.handle_exec_arguments(tool_use_id, arguments)
        else:
            text = arguments if isinstance(arguments, str) else _json_text(arguments)
            rendered = await code_mode.handle_wait(FunctionToolArguments(text))
        return tool_result(tool_use_id, rendered)

    async def handle_all(self, blocks: Iterable[object]) -> list[dict[str, JSON]]:
        """Run the blocks concurrently; their ``tool_result`` blocks, in order."""
        return list(await asyncio.gather(*(self.handle(block) for block in blocks)))


def _json_text(value: object) -> str:
    """``value`` as JSON text; something not JSON-serializable becomes ``null`` (so the wait
    argument parser reports it to the model)."""
    if isinstance(value, Mapping):
        value = dict(value)
    try:
        return json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        return "null"
