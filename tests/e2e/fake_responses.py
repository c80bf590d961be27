"""A scripted OpenAI Responses API on loopback, enough for the Codex CLI to run a turn.

:class:`FakeResponses` answers every ``POST /v1/responses`` with one server-sent-event stream:
``response.created``, one ``response.output_item.done`` per output item, ``response.completed``.
The items come from a script of :class:`Step` s, one step per request: an ``exec`` cell (a
``custom_tool_call``), a ``wait`` call (a ``function_call``) or the final assistant message.
Each request's body is kept, and the outputs Codex sends back for the previous step's calls
(``custom_tool_call_output`` / ``function_call_output``) are collected in order in
:attr:`FakeResponses.outputs`: what the model would have read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

__all__ = ["FakeResponses", "Step", "exec_step", "message_step", "wait_step"]


@dataclass(frozen=True)
class Step:
    """What the fake model answers to one request: output items of the Responses API."""

    items: list[dict[str, Any]]


def exec_step(source: str, call_id: str) -> Step:
    """A ``custom_tool_call`` of the freeform ``exec`` tool with this JavaScript."""
    return Step(
        [
            {
                "type": "custom_tool_call",
                "id": f"ctc_{call_id}",
                "call_id": call_id,
                "name": "exec",
                "input": source,
                "status": "completed",
            }
        ]
    )


def wait_step(call_id: str, **arguments: Any) -> Step:
    """A ``function_call`` of the ``wait`` tool (``cell_id``, ``yield_time_ms``, ``terminate``)."""
    return Step(
        [
            {
                "type": "function_call",
                "id": f"fc_{call_id}",
                "call_id": call_id,
                "name": "wait",
                "arguments": json.dumps(arguments),
                "status": "completed",
            }
        ]
    )


def message_step(text: str = "done") -> Step:
    """The assistant's final message: the turn ends."""
    return Step(
        [
            {
                "type": "message",
                "id": "msg_final",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ]
    )


@dataclass
class FakeResponses:
    """Serves :attr:`steps` in order on ``127.0.0.1``; :meth:`start` returns the base URL."""

    steps: list[Step]
    requests: list[dict[str, Any]] = field(default_factory=list)
    #: ``(call_id, output)`` for each tool output Codex sent back, in the order received.
    outputs: list[tuple[str, Any]] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    _server: asyncio.Server | None = None
    _seen_outputs: set[str] = field(default_factory=set)

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1"

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await self._one(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        line = await reader.readline()
        if not line:
            return False
        method, path, _ = line.decode("latin-1").split(" ", 2)
        headers: dict[str, str] = {}
        while (header := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = header.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        body = b""
        if "content-length" in headers:
            body = await reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size = int((await reader.readline()).split(b";")[0], 16)
                chunk = await reader.readexactly(size + 2)
                if size == 0:
                    break
                body += chunk[:-2]
        self.paths.append(f"{method} {path}")
        if method != "POST" or not path.rstrip("/").endswith("/responses"):
            writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
            return True
        if headers.get("content-encoding"):
            raise AssertionError(f"compressed request body: {headers['content-encoding']}")
        request = json.loads(body)
        self.requests.append(request)
        self._collect(request)
        index = len(self.requests) - 1
        step = self.steps[index] if index < len(self.steps) else message_step()
        await self._stream(writer, f"resp_{index}", step)
        return False  # one response per connection: ``connection: close``

    def _collect(self, request: dict[str, Any]) -> None:
        for item in request.get("input", []):
            kind = item.get("type")
            if kind in ("custom_tool_call_output", "function_call_output"):
                call_id = item["call_id"]
                if call_id not in self._seen_outputs:
                    self._seen_outputs.add(call_id)
                    self.outputs.append((call_id, item.get("output")))

    async def _stream(self, writer: asyncio.StreamWriter, response_id: str, step: Step) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"cache-control: no-cache\r\nconnection: close\r\n\r\n"
        )
        events: list[dict[str, Any]] = [
            {"type": "response.created", "response": {"id": response_id}}
        ]
        events += [{"type": "response.output_item.done", "item": item} for item in step.items]
        events.append(
            {
                "type": "response.completed",
                "response": {
                    "id": response_id,
                    "usage": {
                        "input_tokens": 10,
                        "input_tokens_details": {"cached_tokens": 0},
                        "output_tokens": 10,
                        "output_tokens_details": {"reasoning_tokens": 0},
                        "total_tokens": 20,
                    },
                },
            }
        )
        for event in events:
            writer.write(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode())
        await writer.drain()
