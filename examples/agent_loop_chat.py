"""The agent loop of ``agent_loop.py`` in the OpenAI Chat Completions shape (no network).

Chat Completions tools are JSON function tools, so ``exec`` takes the JavaScript source in its
``code`` argument; replies are ``tool`` messages (images, which a tool message cannot carry, follow
in one ``user`` message). Run it from the repository root::

    python examples/agent_loop_chat.py

To use a real model, replace ``ScriptedModel.respond`` with ``client.chat.completions.create``;
the comment in :func:`agent_loop` shows how.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from weather_agent import FIRST_CELL, RUNNING, SLOW_CELL, add_tools

from codemode import CellId, CodeMode, ToolRegistry

Item = dict[str, Any]

# --- the agent's own tools ----------------------------------------------------------------------

#: notify() texts from cells, sent to the model as user text after the turn's tool results
#: (a tool call gets exactly one reply in this API, so a notification cannot be a second one).
pending_notifications: list[str] = []


def on_notify(call_id: str, cell_id: CellId, text: str) -> None:
    """A cell called notify(): a progress note for its exec call, sent with the next turn."""
    print(f"   notify from cell {cell_id}: {text}")
    pending_notifications.append(f"[progress of tool call {call_id}] {text}")


registry = ToolRegistry(on_notify=on_notify)
add_tools(registry)  # weather, forecast, stats.mean: examples/weather_agent.py

# --- a stand-in for the model --------------------------------------------------------------------


def message_text(message: Item) -> str:
    """The text of a tool message (its text parts joined)."""
    return "".join(part["text"] for part in message["content"])


def tool_call(call_id: str, name: str, arguments: dict[str, Any]) -> Item:
    """A Chat Completions function tool call, as in an assistant message's ``tool_calls``."""
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


class ScriptedModel:
    """Replays a fixed conversation: two ``exec`` calls, a ``wait`` on the cell that yielded,
    then a final answer. Like a real model, it reads what came back to pick its next step."""

    def __init__(self) -> None:
        self._turns: list[Callable[[list[Item]], Item]] = [
            lambda messages: assistant([tool_call("call_1", "exec", {"code": FIRST_CELL})]),
            lambda messages: assistant([tool_call("call_2", "exec", {"code": SLOW_CELL})]),
            self._wait_for_the_running_cell,
            self._answer,
        ]

    async def respond(self, messages: list[Item], tools: list[Item]) -> Item:
        """One model turn: the assistant message for this conversation and these tools."""
        assert [tool["function"]["name"] for tool in tools] == ["exec", "wait"]
        message = self._turns.pop(0)(messages)
        for call in message.get("tool_calls", []):
            print(f"-> model: {call['function']['name']} {call['id']}")
        if "tool_calls" not in message:
            print("-> model: message")
        return message

    @staticmethod
    def _wait_for_the_running_cell(messages: list[Item]) -> Item:
        # The cell id comes from the exec output, exactly as a model would read it.
        match = RUNNING.search(message_text(messages[-1]))
        if match is None:
            raise RuntimeError("expected the forecast cell to be still running")
        arguments = {"cell_id": match.group(1), "yield_time_ms": 10_000}
        return assistant([tool_call("call_3", "wait", arguments)])

    @staticmethod
    def _answer(messages: list[Item]) -> Item:
        forecast_line = message_text(messages[-1]).splitlines()[-1]
        return {"role": "assistant", "content": f"Here is what I found. {forecast_line}"}


def assistant(tool_calls: list[Item]) -> Item:
    """An assistant message that only calls tools."""
    return {"role": "assistant", "content": None, "tool_calls": tool_calls}


# --- the agent loop ------------------------------------------------------------------------------


def show(message: Item) -> None:
    """Print one message the loop sends back to the model."""
    label = message.get("tool_call_id", "")
    print(f"<- {message['role']} {label}".rstrip())
    for part in message["content"]:
        text = part.get("text", f"[{part['type']}]")
        for line in text.rstrip("\n").splitlines():
            print(f"   | {line}")


async def agent_loop(model: ScriptedModel, code_mode: CodeMode, prompt: str) -> str:
    """Ask the model until it answers without tool calls; run every exec/wait call it makes."""
    chat = code_mode.chat_completions
    messages: list[Item] = [{"role": "user", "content": prompt}]
    while True:
        # With a real model this is the only part that changes:
        #     completion = await client.chat.completions.create(
        #         model="gpt-5", messages=messages, tools=chat.tools()
        #     )
        #     message = completion.choices[0].message
        # The SDK's message goes into `messages` and its `tool_calls` through `handles` /
        # `handle_all` as they are; the final answer is `message.content`.
        message = await model.respond(messages, chat.tools())
        messages.append(message)
        calls = [call for call in message.get("tool_calls", []) if chat.handles(call)]
        if not calls:
            return str(message["content"])
        # Parallel calls run concurrently; every tool message comes before any user message.
        replies = await chat.handle_all(calls)
        if pending_notifications:
            notes = [{"type": "text", "text": note} for note in pending_notifications]
            replies.append({"role": "user", "content": notes})
            pending_notifications.clear()
        for reply in replies:
            show(reply)
        messages += replies


async def main() -> int:
    """Run the loop once with the embedded runtime; the session closes with the ``async with``."""
    async with CodeMode(registry) as code_mode:
        answer = await agent_loop(ScriptedModel(), code_mode, "What is the weather like?")
    print(f"assistant: {answer}")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
