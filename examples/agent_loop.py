"""A complete agent loop with code mode, against a scripted stand-in for the model (no network).

The model gets two tools, ``exec`` (run JavaScript) and ``wait`` (keep watching a cell that
yielded); the JavaScript calls the Python tools below through the global ``tools`` object. Run it
from the repository root::

    python examples/agent_loop.py

To use a real model, replace ``ScriptedModel.respond`` with your client's call; the comment in
:func:`agent_loop` shows the OpenAI Responses API version. Nothing else changes.
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

#: notify() texts from cells, as output items waiting for the next model turn.
pending_notifications: list[Item] = []


def on_notify(call_id: str, cell_id: CellId, text: str) -> None:
    """A cell called notify(): an extra output for its exec call, sent with the next turn."""
    print(f"   notify from cell {cell_id}: {text}")
    pending_notifications.append(
        {"type": "custom_tool_call_output", "call_id": call_id, "output": text}
    )


registry = ToolRegistry(on_notify=on_notify)
add_tools(registry)  # weather, forecast, stats.mean: examples/weather_agent.py

# --- a stand-in for the model --------------------------------------------------------------------


def output_text(item: Item) -> str:
    """The text of an exec/wait output item (its content items joined)."""
    return "".join(part.get("text", "") for part in item["output"])


class ScriptedModel:
    """Replays a fixed conversation: two ``exec`` calls, a ``wait`` on the cell that yielded,
    then a final answer. Like a real model, it reads what came back to pick its next step."""

    def __init__(self) -> None:
        self._turns: list[Callable[[list[Item]], list[Item]]] = [
            lambda history: [exec_call("call_1", FIRST_CELL)],
            lambda history: [exec_call("call_2", SLOW_CELL)],
            self._wait_for_the_running_cell,
            self._answer,
        ]

    async def respond(self, history: list[Item], tools: list[Item]) -> list[Item]:
        """One model turn: the output items for this conversation and these tools."""
        assert [tool["name"] for tool in tools] == ["exec", "wait"]
        output = self._turns.pop(0)(history)
        for item in output:
            step = f"{item['name']} {item['call_id']}" if "call_id" in item else item["type"]
            print(f"-> model: {step}")
        return output

    @staticmethod
    def _wait_for_the_running_cell(history: list[Item]) -> list[Item]:
        # The cell id comes from the exec output, exactly as a model would read it.
        match = RUNNING.search(output_text(history[-1]))
        if match is None:
            raise RuntimeError("expected the forecast cell to be still running")
        arguments = json.dumps({"cell_id": match.group(1), "yield_time_ms": 10_000})
        return [
            {"type": "function_call", "call_id": "call_3", "name": "wait", "arguments": arguments}
        ]

    @staticmethod
    def _answer(history: list[Item]) -> list[Item]:
        forecast_line = output_text(history[-1]).splitlines()[-1]
        text = f"Here is what I found. {forecast_line}"
        return [
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": text}],
            }
        ]


def exec_call(call_id: str, source: str) -> Item:
    """A Responses API custom tool call of ``exec``."""
    return {"type": "custom_tool_call", "call_id": call_id, "name": "exec", "input": source}


# --- the agent loop ------------------------------------------------------------------------------


def final_text(output: list[Item]) -> str:
    """The assistant's text in a turn without tool calls."""
    messages = [item for item in output if item.get("type") == "message"]
    return "".join(part["text"] for item in messages for part in item["content"])


def show(item: Item) -> None:
    """Print one output item the loop sends back to the model."""
    print(f"<- {item['type']} {item['call_id']}")
    for part in item["output"]:
        text = part.get("text", f"[{part['type']}]")
        for line in text.rstrip("\n").splitlines():
            print(f"   | {line}")


async def agent_loop(model: ScriptedModel, code_mode: CodeMode, prompt: str) -> str:
    """Ask the model until it answers without tool calls; run every exec/wait call it makes."""
    history: list[Item] = [{"role": "user", "content": prompt}]
    while True:
        history += pending_notifications
        pending_notifications.clear()
        # With a real model this is the only line that changes, e.g. the OpenAI Responses API:
        #     response = await client.responses.create(
        #         model="gpt-5", input=history, tools=code_mode.tools()
        #     )
        #     output = response.output
        # The SDK's output objects go back into `history` and through `handles`/`handle` as they
        # are; the final answer is then `response.output_text`. Clients with another tool format
        # convert the two specs of `code_mode.tools()`, pass the raw source or argument JSON to
        # `code_mode.handle_exec(call_id, source)` / `code_mode.handle_wait(arguments)` and send
        # the returned items (`.to_json()`) back.
        output = await model.respond(history, code_mode.tools())
        history += output
        calls = [item for item in output if CodeMode.handles(item)]
        if not calls:
            return final_text(output)
        # Parallel calls run concurrently; each answer goes back under its own call id.
        results = await asyncio.gather(*(code_mode.handle(call) for call in calls))
        for result in results:
            show(result)
        history += results


async def main() -> int:
    """Run the loop once with the embedded runtime; the session closes with the ``async with``."""
    async with CodeMode(registry) as code_mode:
        answer = await agent_loop(ScriptedModel(), code_mode, "What is the weather like?")
    print(f"assistant: {answer}")
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
