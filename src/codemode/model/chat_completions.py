"""The ``exec`` and ``wait`` tools in the OpenAI Chat Completions shape, over :class:`CodeMode`.

Chat Completions takes function tools everywhere (and freeform custom tools only on some
models), so by default ``exec`` is a function tool whose one string argument ``code`` is the
JavaScript source; ``wait`` is a function tool as in the Responses shape::

    chat = code_mode.chat_completions
    completion = await client.chat.completions.create(model=..., messages=messages,
                                                      tools=chat.tools())
    message = completion.choices[0].message
    messages.append(message)
    calls = [call for call in message.tool_calls or [] if chat.handles(call)]
    messages += await chat.handle_all(calls)

A reply is a ``{"role": "tool", "tool_call_id", "content"}`` message whose content is the output's
text parts. Tool messages cannot carry images, so each image becomes a text placeholder there and
the image itself goes into one ``user`` message sent after all the tool messages of the turn
(:meth:`ChatCompletions.handle_all` puts them in that order). Audio items become a text
placeholder.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from codemode.model.codemode import _field, _text_field, exec_code_parameters
from codemode.model.exec_tool import EXEC_GRAMMAR, WAIT_PARAMETERS
from codemode.model.handler import CustomToolInput, FunctionToolArguments
from codemode.model.render import DEFAULT_IMAGE_DETAIL, RenderedOutput
from codemode.protocol.constants import PUBLIC_TOOL_NAME, WAIT_TOOL_NAME
from codemode.protocol.types import JSON, InputImage, InputText

if TYPE_CHECKING:
    from codemode.model.codemode import CodeMode

__all__ = ["AUDIO_PLACEHOLDER", "ChatCompletions", "ChatReply", "image_placeholder"]

_NAMES: Final = (PUBLIC_TOOL_NAME, WAIT_TOOL_NAME)

#: What an audio item becomes: Chat Completions tool messages carry text only.
AUDIO_PLACEHOLDER: Final = "[audio omitted: a Chat Completions tool message carries text only]"


def image_placeholder(number: int) -> str:
    """The text standing in a tool message for the output's ``number``-th image (from 1)."""
    return f"[image {number}: attached in the user message that follows the tool results]"


@dataclass(frozen=True, slots=True)
class ChatReply:
    """One call's reply: the ``tool`` message, and the image parts for the following user
    message (``image_url`` content parts, empty when the output had no image)."""

    tool_message: dict[str, JSON]
    image_parts: list[dict[str, JSON]]

    def messages(self) -> list[dict[str, JSON]]:
        """The tool message, then a user message with the images if there are any."""
        return [self.tool_message, *_image_messages([self])]


def _image_messages(replies: Iterable[ChatReply]) -> list[dict[str, JSON]]:
    """One user message with every reply's images, each group introduced by its call id."""
    content: list[JSON] = []
    for reply in replies:
        if reply.image_parts:
            call_id = reply.tool_message["tool_call_id"]
            content.append({"type": "text", "text": f"Images from tool call {call_id}:"})
            content.extend(reply.image_parts)
    return [{"role": "user", "content": content}] if content else []


def _reply(call_id: str, rendered: RenderedOutput) -> ChatReply:
    parts: list[JSON] = []
    images: list[dict[str, JSON]] = []
    for item in rendered.items:
        if isinstance(item, InputText):
            parts.append({"type": "text", "text": item.text})
        elif isinstance(item, InputImage):
            detail = item.detail or DEFAULT_IMAGE_DETAIL
            images.append(
                {"type": "image_url", "image_url": {"url": item.image_url, "detail": detail.value}}
            )
            parts.append({"type": "text", "text": image_placeholder(len(images))})
        else:
            parts.append({"type": "text", "text": AUDIO_PLACEHOLDER})
    message: dict[str, JSON] = {"role": "tool", "tool_call_id": call_id, "content": parts}
    return ChatReply(message, images)


class ChatCompletions:
    """The Chat Completions face of a :class:`CodeMode` (get it as ``code_mode.chat_completions``)."""

    def __init__(self, code_mode: CodeMode) -> None:
        self.code_mode = code_mode

    def tools(self, *, freeform: bool = False) -> list[dict[str, JSON]]:
        """``exec`` and ``wait`` as Chat Completions tools.

        By default ``exec`` is a function tool taking the source in ``code``. ``freeform=True``
        makes it a custom tool constrained by the exec grammar instead, for models that accept
        custom tools; :meth:`handles` and :meth:`handle` take both kinds of call either way.
        """
        if freeform:
            exec_tool: dict[str, JSON] = {
                "type": "custom",
                "custom": {
                    "name": PUBLIC_TOOL_NAME,
                    "description": self.code_mode.exec_description(),
                    "format": {
                        "type": "grammar",
                        "grammar": {"syntax": "lark", "definition": EXEC_GRAMMAR},
                    },
                },
            }
        else:
            exec_tool = _function_tool(
                PUBLIC_TOOL_NAME,
                self.code_mode.exec_function_description(),
                exec_code_parameters(),
            )
        wait_tool = _function_tool(
            WAIT_TOOL_NAME, self.code_mode.wait_description(), copy.deepcopy(WAIT_PARAMETERS)
        )
        return [exec_tool, wait_tool]

    @staticmethod
    def handles(call: object) -> bool:
        """True for a Chat Completions tool call (mapping or SDK object) of ``exec``/``wait``:
        ``type: "function"`` with ``function.name``, or ``type: "custom"`` with ``custom.name``."""
        kind = _field(call, "type")
        if kind not in ("function", "custom"):
            return False
        body = _field(call, kind)
        return body is not None and _field(body, "name") in _NAMES

    async def handle(self, call: object) -> ChatReply:
        """Run one ``exec``/``wait`` tool call; the reply's :meth:`ChatReply.messages` go back.

        Raises :class:`ValueError` for a call :meth:`handles` does not claim or that lacks its
        fields (a programming error, not the model's).
        """
        if not self.handles(call):
            raise ValueError("not a Chat Completions exec or wait tool call")
        kind = _field(call, "type")
        assert isinstance(kind, str)
        body = _field(call, kind)
        name = _field(body, "name")
        call_id = _text_field(call, "id")
        code_mode = self.code_mode
        if kind == "function":
            arguments = _text_field(body, "arguments")
            if name == PUBLIC_TOOL_NAME:
                rendered = await code_mode.handle_exec_arguments(call_id, arguments)
            else:
                rendered = await code_mode.handle_wait(FunctionToolArguments(arguments))
        else:
            payload = CustomToolInput(_text_field(body, "input"))
            if name == PUBLIC_TOOL_NAME:
                rendered = await code_mode.handle_exec(call_id, payload)
            else:
                rendered = await code_mode.handle_wait(payload)
        return _reply(call_id, rendered)

    async def handle_all(self, calls: Iterable[object]) -> list[dict[str, JSON]]:
        """Run the calls concurrently; their tool messages in call order, then one user message
        with all their images (Chat Completions wants every tool message right after the
        assistant message that made the calls)."""
        replies = await asyncio.gather(*(self.handle(call) for call in calls))
        return [*(reply.tool_message for reply in replies), *_image_messages(replies)]


def _function_tool(name: str, description: str, parameters: dict[str, JSON]) -> dict[str, JSON]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": parameters,
            "strict": False,
        },
    }
