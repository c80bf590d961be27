"""The agent loop of ``agent_loop.py`` in the Anthropic Messages shape (no network).

Anthropic tools are JSON tools, so ``exec`` takes the JavaScript source in its ``code`` input; the
model calls them with ``tool_use`` blocks, answered by ``tool_result`` blocks (text and image
blocks, ``is_error`` when the script failed) in the next user message. Run it from the repository
root::

    python examples/agent_loop_anthropic.py

To use a real model, replace ``ScriptedModel.respond`` with ``client.messages.create``; the
comment in :func:`agent_loop` shows how.
"""

from __future__ import annotations

import asyncio
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


def result_text(message: Item) -> str:
    """The text of the last tool_result in a user message (its text blocks joined)."""
    results = [block for block in message["content"] if block["type"] == "tool_result"]
    return "".join(block.get("text", "") for block in results[-1]["content"])


def tool_use(block_id: str, name: str, arguments: dict[str, Any]) -> Item:
    """An Anthropic ``tool_use`` content block."""
    return {"type": "tool_use", "id": block_id, "name": name, "input": arguments}


class ScriptedModel:
    """Replays a fixed conversation: two ``exec`` calls, a ``wait`` on the cell that yielded,
    then a final answer. Like a real model, it reads what came back to pick its next step."""

    def __init__(self) -> None:
        self._turns: list[Callable[[list[Item]], list[Item]]] = [
            lambda messages: [tool_use("toolu_1", "exec", {"code": FIRST_CELL})],
            lambda messages: [tool_use("toolu_2", "exec", {"code": SLOW_CELL})],
            self._wait_for_the_running_cell,
            self._answer,
        ]

    async def respond(self, messages: list[Item], tools: list[Item]) -> list[Item]:
        """One model turn: the assistant content blocks for this conversation and these tools."""
        assert [tool["name"] for tool in tools] == ["exec", "wait"]
        content = self._turns.pop(0)(messages)
        for block in content:
            step = f"{block['name']} {block['id']}" if block["type"] == "tool_use" else "message"
            print(f"-> model: {step}")
        return content

    @staticmethod
    def _wait_for_the_running_cell(messages: list[Item]) -> list[Item]:
        # The cell id comes from the exec output, exactly as a model would read it.
        match = RUNNING.search(result_text(messages[-1]))
        if match is None:
            raise RuntimeError("expected the forecast cell to be still running")
        arguments = {"cell_id": match.group(1), "yield_time_ms": 10_000}
        return [tool_use("toolu_3", "wait", arguments)]

    @staticmethod
    def _answer(messages: list[Item]) -> list[Item]:
        forecast_line = result_text(messages[-1]).splitlines()[-1]
        return [{"type": "text", "text": f"Here is what I found. {forecast_line}"}]


# --- the agent loop ------------------------------------------------------------------------------


def show(block: Item) -> None:
    """Print one content block the loop sends back to the model."""
    label = block.get("tool_use_id", "")
    error = " (is_error)" if block.get("is_error") else ""
    print(f"<- {block['type']} {label}{error}".rstrip())
    parts = block["content"] if block["type"] == "tool_result" else [block]
    for part in parts:
        text = part.get("text", f"[{part['type']}]")
        for line in text.rstrip("\n").splitlines():
            print(f"   | {line}")


async def agent_loop(model: ScriptedModel, code_mode: CodeMode, prompt: str) -> str:
    """Ask the model until it answers without tool calls; run every exec/wait call it makes."""
    anthropic = code_mode.anthropic
    messages: list[Item] = [{"role": "user", "content": prompt}]
    while True:
        # With a real model this is the only part that changes:
        #     message = await client.messages.create(
        #         model="claude-sonnet-4-5", max_tokens=4096, messages=messages,
        #         tools=anthropic.tools(),
        #     )
        #     content = message.content
        # The SDK's blocks go into `messages` and through `handles` / `handle_all` as they are.
        content = await model.respond(messages, anthropic.tools())
        messages.append({"role": "assistant", "content": content})
        calls = [block for block in content if anthropic.handles(block)]
        if not calls:
            return "".join(block["text"] for block in content if block["type"] == "text")
        # Parallel calls run concurrently; all results go back in one user message, tool_result
        # blocks first, then any notifications as text.
        reply: list[Item] = list(await anthropic.handle_all(calls))
        reply += [{"type": "text", "text": note} for note in pending_notifications]
        pending_notifications.clear()
        for block in reply:
            show(block)
        messages.append({"role": "user", "content": reply})


async def main() -> int:
    """Run the loop once with the embedded runtime; the session closes with the ``async with``."""
    async with CodeMode(registry) as code_mode:
        answer = await agent_loop(ScriptedModel(), code_mode, "What is the weather like?")
    print(f"assistant: {answer}")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
