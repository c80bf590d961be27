"""One object for an agent loop: tools for the model in, rendered outputs out.

:class:`CodeMode` owns a session (the embedded runtime unless you bring one), publishes the
``exec`` and ``wait`` tools in the OpenAI Responses API shape, and answers the model's calls with
ready-to-send output items::

    async with CodeMode(registry) as code_mode:
        response = await client.responses.create(model=..., input=history, tools=code_mode.tools())
        for call in response.output:
            if code_mode.handles(call):
                history.append(await code_mode.handle(call))
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final

from codemode.errors import CodeModeError
from codemode.model.exec_tool import (
    ARGUMENTS_TOO_DEEP,
    build_exec_description,
    build_wait_description,
    exec_tool_spec,
    wait_tool_spec,
)
from codemode.model.handler import (
    CodeModeToolHandler,
    CustomToolInput,
    FunctionToolArguments,
    ToolPayload,
)
from codemode.model.registry import NotifyCallback, Tool, ToolRegistry
from codemode.model.render import RenderedOutput
from codemode.protocol.constants import (
    DEFAULT_EXEC_YIELD_TIME_MS,
    DEFAULT_WAIT_YIELD_TIME_MS,
    PUBLIC_TOOL_NAME,
    WAIT_TOOL_NAME,
)
from codemode.protocol.texts import SESSION_SHUTTING_DOWN
from codemode.protocol.types import (
    JSON,
    CellId,
    CodeModeSessionCellExecutionLimits,
    InputText,
)
from codemode.runtime import LocalSessionProvider
from codemode.session import (
    CodeModeSession,
    CodeModeSessionProvider,
)

if TYPE_CHECKING:
    from codemode.model.anthropic import AnthropicMessages
    from codemode.model.chat_completions import ChatCompletions

__all__ = ["CODE_MODE_CLOSED", "EXEC_CODE_ARGUMENT", "CodeMode", "exec_code_parameters"]

_CUSTOM_CALL: Final = "custom_tool_call"
_FUNCTION_CALL: Final = "function_call"
_OUTPUT_TYPES: Final = {
    _CUSTOM_CALL: "custom_tool_call_output",
    _FUNCTION_CALL: "function_call_output",
}


#: The argument carrying the JavaScript source where ``exec`` is a JSON function tool (Chat
#: Completions, Anthropic Messages), i.e. where the API has no freeform tools.
EXEC_CODE_ARGUMENT: Final = "code"

# The exec description is written for a freeform tool; a JSON function tool takes the source in
# one string argument, so the freeform-only sentences are rewritten (checked by the tests).
_FREEFORM_SENTENCE: Final = (
    "- Send raw JavaScript source text: not JSON, not a quoted string, not a markdown code fence."
)
_FUNCTION_SENTENCE: Final = (
    f"- Put the JavaScript source text in the `{EXEC_CODE_ARGUMENT}` string argument: plain "
    "source, not a markdown code fence."
)
_FREEFORM_NOTIFY: Final = "injects an extra `custom_tool_call_output` for the current `exec` call"
_FUNCTION_NOTIFY: Final = "reports a progress message for the current `exec` call to the agent"


def exec_code_parameters() -> dict[str, JSON]:
    """The JSON Schema of ``exec`` as a function tool: one required string, the source."""
    return {
        "type": "object",
        "properties": {
            EXEC_CODE_ARGUMENT: {
                "type": "string",
                "description": (
                    "The JavaScript source to run, optionally starting with a "
                    "`// @exec: {...}` pragma line."
                ),
            }
        },
        "required": [EXEC_CODE_ARGUMENT],
        "additionalProperties": False,
    }


def _integer(digits: str) -> int:
    if len(digits) > _MAX_INTEGER_DIGITS:  # else Python's advice to raise its digit limit
        raise ValueError(f"integer of {len(digits)} digits out of range")
    return int(digits)


_MAX_INTEGER_DIGITS: Final = 4000


def _exec_code(arguments: object) -> str:
    """The source in ``exec`` function arguments (JSON text or a mapping), or a failure text."""
    if isinstance(arguments, str | bytes):
        try:
            # json, not strict JSON: a lone surrogate escape in the code runs as U+FFFD.
            arguments = json.loads(arguments, parse_int=_integer)
        except ValueError as error:
            raise CodeModeError(f"failed to parse function arguments: {error}") from None
        except RecursionError:
            raise CodeModeError(ARGUMENTS_TOO_DEEP) from None
    code = arguments.get(EXEC_CODE_ARGUMENT) if isinstance(arguments, Mapping) else None
    if not isinstance(code, str):
        raise CodeModeError(
            f"failed to parse function arguments: expected an object with a string "
            f"`{EXEC_CODE_ARGUMENT}`"
        )
    return code


#: What a call after :meth:`CodeMode.aclose` gets when aclose did not shut a session down (one
#: given to the CodeMode stays open; none may have been opened yet).
CODE_MODE_CLOSED: Final = "code mode is closed"


def _field(call: object, key: str) -> object:
    """``call[key]`` for a mapping, ``call.key`` for an SDK object; ``None`` when absent."""
    if isinstance(call, Mapping):
        return call.get(key)
    return getattr(call, key, None)


def _text_field(call: object, key: str) -> str:
    value = _field(call, key)
    if not isinstance(value, str):
        raise ValueError(f"tool call has no string `{key}`")
    return value


class CodeMode:
    """Code mode for one agent thread: owns a session and serves the model's exec/wait calls.

    ``tools`` is a :class:`ToolRegistry` (the session's delegate) or tools to put in a new one
    (with ``on_notify``). Without ``session`` or ``provider``, an embedded
    :class:`~codemode.runtime.LocalSessionProvider` session is opened on first use. A given
    ``session`` must already serve ``tools`` through its delegate and is not shut down by
    :meth:`aclose` (only the cells started here are terminated); a session opened from
    ``provider`` (with ``limits``) is shut down, the provider is left open. ``code_mode_only``:
    the model reaches the nested tools only through ``exec``, so their declarations go into the
    exec description. ``store_load`` and ``console`` (an opt-in ``console.log`` that appends text)
    configure the embedded runtime and the description (match them to a session you bring); ``clock`` measures the wall time shown to the model.
    """

    def __init__(
        self,
        tools: ToolRegistry | Iterable[Tool[..., Any]] = (),
        *,
        session: CodeModeSession | None = None,
        provider: CodeModeSessionProvider | None = None,
        limits: CodeModeSessionCellExecutionLimits | None = None,
        on_notify: NotifyCallback | None = None,
        code_mode_only: bool = True,
        store_load: bool = True,
        image_detail: bool = True,
        console: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if session is not None and (provider is not None or limits is not None):
            raise ValueError("pass either an open session or a provider and limits, not both")
        if isinstance(tools, ToolRegistry):
            if on_notify is not None:
                raise ValueError("give on_notify to the ToolRegistry that serves the session")
            self.registry = tools
        else:
            self.registry = ToolRegistry(tools, on_notify=on_notify)
        self._given_session = session
        self._provider = provider
        self._limits = limits or CodeModeSessionCellExecutionLimits()
        self._code_mode_only = code_mode_only
        self._store_load = store_load
        self._image_detail = image_detail
        self._console = console
        self._clock = clock
        self._handler: CodeModeToolHandler | None = None
        self._owned_provider: LocalSessionProvider | None = None
        self._opening = asyncio.Lock()
        self._closed = False

    # -- the session -----------------------------------------------------------------------------

    @property
    def session(self) -> CodeModeSession | None:
        """The session calls run on; ``None`` until it is opened (first call or :meth:`start`)."""
        return None if self._handler is None else self._handler.session

    @property
    def live_cells(self) -> Mapping[CellId, str]:
        """Cells started here that yielded and have not ended, with their exec call ids."""
        return {} if self._handler is None else self._handler.live_cells

    async def start(self) -> CodeModeSession:
        """Open the session now instead of on the first call; errors opening it propagate."""
        handler = await self._ensure_handler()
        if handler is None:
            raise CodeModeError(self._closed_text())
        return handler.session

    def _closed_text(self) -> str:
        """The failure of a call after :meth:`aclose`: the session's own shut-down text where
        aclose shut it down, else :data:`CODE_MODE_CLOSED` (a given session is still open)."""
        if self._handler is not None and self._given_session is None:
            return SESSION_SHUTTING_DOWN
        return CODE_MODE_CLOSED

    def _closed_output(self) -> RenderedOutput:
        return RenderedOutput([InputText(self._closed_text())], success=False)

    async def _ensure_handler(self) -> CodeModeToolHandler | None:
        """The handler, opening the session first if needed; ``None`` once closed."""
        # A lock, because the model may issue parallel calls before the session exists.
        async with self._opening:
            if self._closed:
                return None
            if self._handler is None:
                session = self._given_session
                if session is None:
                    session = await self._open_session()
                self._handler = CodeModeToolHandler(
                    session,
                    self.registry.definitions,
                    clock=self._clock,
                    cell_spans=self.registry.cell_spans,
                )
            return self._handler

    async def _open_session(self) -> CodeModeSession:
        provider = self._provider
        if provider is None:
            # Its one session takes the one engine it starts: no spare is kept warm beside it
            # (a server with a CodeMode per conversation would run two processes for each).
            provider = self._owned_provider = LocalSessionProvider(
                store_load=self._store_load, console=self._console, warm_engines=0
            )
        try:
            return await provider.create_session_with_limits(self.registry, self._limits)
        except BaseException:
            if self._owned_provider is not None:
                await self._owned_provider.aclose()
                self._owned_provider = None
            raise

    async def aclose(self) -> None:
        """Stop: shut down an opened session (and the embedded engine), or terminate own cells.

        Idempotent. Afterwards every exec/wait call fails: with ``code mode session is shutting
        down`` where a session was shut down here, else with :data:`CODE_MODE_CLOSED`.
        """
        async with self._opening:
            if self._closed:
                return
            self._closed = True
        handler = self._handler
        if handler is not None and self._given_session is not None:
            # Not our session: leave it running, but do not leave our cells running in it.
            for cell_id in handler.live_cells:
                with contextlib.suppress(CodeModeError):
                    await handler.session.terminate(cell_id)
        elif handler is not None:
            await handler.session.shutdown()
        if handler is not None:
            for cell_id in handler.live_cells:
                handler.finish_span(cell_id, "terminated")
        if self._owned_provider is not None:
            await self._owned_provider.aclose()

    async def __aenter__(self) -> CodeMode:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- the model-facing tools ------------------------------------------------------------------

    def exec_description(self) -> str:
        """The ``exec`` tool description for the registry's current tools."""
        return build_exec_description(
            self.registry.definitions(),
            code_mode_only=self._code_mode_only,
            namespace_descriptions=self.registry.namespace_descriptions(),
            store_load=self._store_load,
            image_detail=self._image_detail,
            default_yield_time_ms=self._default_yield_ms(DEFAULT_EXEC_YIELD_TIME_MS),
            console=self._console,
        )

    def wait_description(self) -> str:
        """The ``wait`` tool description, with this session's default yield time."""
        return build_wait_description(self._default_yield_ms(DEFAULT_WAIT_YIELD_TIME_MS))

    def _default_yield_ms(self, default: int) -> int:
        # The session caps every observation's yield time (runtime.md §13.10): an observation
        # without one then yields at the cap, which is the default the model must be told
        # (§15.1, §15.2).
        cap = self._limits.max_yield_time_ms
        return default if cap is None else min(cap, default)

    def tools(self) -> list[dict[str, JSON]]:
        """The ``exec`` (custom, grammar) and ``wait`` (function) tools, Responses API shape."""
        return [exec_tool_spec(self.exec_description()), wait_tool_spec(self.wait_description())]

    @staticmethod
    def handles(call: object) -> bool:
        """True for a Responses ``custom_tool_call``/``function_call`` named ``exec`` or ``wait``.

        Items of other APIs (a Chat Completions tool call, an Anthropic ``tool_use`` block) are
        not claimed: see :attr:`chat_completions` and :attr:`anthropic`.
        """
        return _field(call, "type") in _OUTPUT_TYPES and _field(call, "name") in (
            PUBLIC_TOOL_NAME,
            WAIT_TOOL_NAME,
        )

    @property
    def chat_completions(self) -> ChatCompletions:
        """The tools, call recognition and replies in the OpenAI Chat Completions shape."""
        from codemode.model.chat_completions import ChatCompletions

        return ChatCompletions(self)

    @property
    def anthropic(self) -> AnthropicMessages:
        """The tools, call recognition and replies in the Anthropic Messages shape."""
        from codemode.model.anthropic import AnthropicMessages

        return AnthropicMessages(self)

    def exec_function_description(self) -> str:
        """The ``exec`` description for APIs where exec is a JSON function tool (``code``)."""
        return (
            self.exec_description()
            .replace(_FREEFORM_SENTENCE, _FUNCTION_SENTENCE)
            .replace(_FREEFORM_NOTIFY, _FUNCTION_NOTIFY)
        )

    async def handle(self, call: object) -> dict[str, JSON]:
        """Run one ``exec``/``wait`` call and return its output item for the next model turn.

        ``call`` is a Responses API ``custom_tool_call`` or ``function_call`` item, as a mapping
        or an SDK object. The reply is the matching ``custom_tool_call_output`` or
        ``function_call_output`` whose ``output`` is the rendered content items.
        """
        name = _field(call, "name")
        if name not in (PUBLIC_TOOL_NAME, WAIT_TOOL_NAME):
            raise ValueError(f"not an exec or wait call: {name!r}")
        call_type = _field(call, "type")
        call_id = _text_field(call, "call_id")
        payload: ToolPayload
        if call_type == _CUSTOM_CALL:
            payload = CustomToolInput(_text_field(call, "input"))
        elif call_type == _FUNCTION_CALL:
            payload = FunctionToolArguments(_text_field(call, "arguments"))
        else:
            raise ValueError(f"unsupported tool call type {call_type!r}")
        if name == PUBLIC_TOOL_NAME:
            rendered = await self.handle_exec(call_id, payload)
        else:
            rendered = await self.handle_wait(payload)
        return {"type": _OUTPUT_TYPES[call_type], "call_id": call_id, "output": rendered.to_json()}

    async def handle_exec(self, call_id: str, payload: ToolPayload | str) -> RenderedOutput:
        """Run an ``exec`` call (raw source or payload) and render its initial response."""
        handler = await self._ensure_handler()
        if handler is None:
            return self._closed_output()
        return await handler.handle_exec(call_id, payload)

    async def handle_exec_arguments(self, call_id: str, arguments: object) -> RenderedOutput:
        """Run ``exec`` given as a function call: ``arguments`` is the JSON text or a mapping
        with the source under :data:`EXEC_CODE_ARGUMENT`; bad arguments come back as a failure
        text for the model, like bad ``wait`` arguments."""
        try:
            code = _exec_code(arguments)
        except CodeModeError as error:
            return RenderedOutput([InputText(error.message)], success=False)
        return await self.handle_exec(call_id, code)

    async def handle_wait(
        self, payload: ToolPayload | str | Mapping[str, object]
    ) -> RenderedOutput:
        """Run a ``wait`` call (JSON argument text, a payload, or the arguments as a mapping) and
        render its outcome."""
        handler = await self._ensure_handler()
        if handler is None:
            return self._closed_output()
        return await handler.handle_wait(payload)
