"""``exec``/``wait`` in the OpenAI Chat Completions shape, checked against the ``openai`` SDK's types.

:func:`assert_conforms` (also used by the Anthropic tests) checks a value against an SDK
``TypedDict`` strictly: required keys present, no unknown keys, every nested value of its declared
type. (pydantic's ``TypeAdapter`` ignores unknown keys of a ``TypedDict`` and validates
``Iterable`` fields lazily, so it alone would let a wrong reply through.)
"""

from __future__ import annotations

import collections.abc
import json
import types
import typing
from collections.abc import AsyncIterator
from typing import Any

import pytest
import typing_extensions
from openai.types.chat import (
    ChatCompletionCustomToolParam,
    ChatCompletionFunctionToolParam,
    ChatCompletionMessage,
    ChatCompletionMessageCustomToolCall,
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionMessageParam,
    ChatCompletionToolMessageParam,
    ChatCompletionToolUnionParam,
    ChatCompletionUserMessageParam,
)
from pydantic import TypeAdapter
from typing_extensions import is_typeddict

from codemode.model import EXEC_CODE_ARGUMENT, ChatCompletions, ChatReply, CodeMode
from codemode.model.chat_completions import AUDIO_PLACEHOLDER, image_placeholder
from codemode.protocol.types import CellId, ImageDetail, InputAudio, InputImage, InputText, Result
from tests.model.test_codemode import RecordingFakeSession, clock, sample_registry

PNG = "data:image/png;base64,iVBORw0KGgo="

# --- strict conformance to an SDK type -----------------------------------------------------------


def _errors(tp: Any, value: object, path: str) -> list[str]:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is typing.Any or tp is object:
        return []
    if origin is typing.Annotated:
        return _errors(args[0], value, path)
    if origin in (typing.Union, types.UnionType):
        branches = [_errors(arg, value, path) for arg in args]
        if any(not branch for branch in branches):
            return []
        return [f"{path}: matches no branch of {tp}: {min(branches, key=len)}"]
    if origin is typing.Literal:
        return [] if value in args else [f"{path}: {value!r} not in {args}"]
    if tp is type(None):
        return [] if value is None else [f"{path}: {value!r} is not None"]
    if is_typeddict(tp):
        return _typeddict_errors(tp, value, path)
    if origin in (dict, collections.abc.Mapping):
        if not isinstance(value, dict):
            return [f"{path}: {type(value).__name__} is not a dict"]
        return [e for key, item in value.items() for e in _errors(args[1], item, f"{path}.{key}")]
    if origin in (list, collections.abc.Iterable, collections.abc.Sequence) or (
        getattr(tp, "__name__", "") == "SequenceNotStr"
    ):
        if not isinstance(value, list):
            return [f"{path}: {type(value).__name__} is not a list"]
        return [e for i, item in enumerate(value) for e in _errors(args[0], item, f"{path}[{i}]")]
    if tp is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return [] if ok else [f"{path}: {value!r} is not a number"]
    if tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        return [] if ok else [f"{path}: {value!r} is not an int"]
    if isinstance(origin or tp, type):
        ok = isinstance(value, origin or tp)
        return [] if ok else [f"{path}: {value!r} is not a {tp}"]
    raise AssertionError(f"{path}: cannot check against {tp!r}")


def _typeddict_errors(tp: Any, value: object, path: str) -> list[str]:
    if not isinstance(value, dict):
        return [f"{path}: {type(value).__name__} is not a {tp.__name__}"]
    hints = typing.get_type_hints(tp)
    errors = [f"{path}: missing {key!r}" for key in _required_keys(tp) if key not in value]
    extra_allowed = getattr(tp, "__pydantic_config__", {}).get("extra") == "allow"
    for key, item in value.items():
        if key in hints:
            errors += _errors(hints[key], item, f"{path}.{key}")
        elif not extra_allowed:
            errors.append(f"{path}: unknown key {key!r} for {tp.__name__}")
    return errors


def _required_keys(tp: Any) -> set[str]:
    # With `from __future__ import annotations` (as the SDKs write them) `__required_keys__` cannot
    # see `Required[...]`, so it is read from the resolved annotations.
    required: set[str] = set()
    for key, hint in typing.get_type_hints(tp, include_extras=True).items():
        marker = typing.get_origin(hint)
        if marker in (typing.Required, typing_extensions.Required) or (
            tp.__total__ and marker not in (typing.NotRequired, typing_extensions.NotRequired)
        ):
            required.add(key)
    return required


def assert_conforms(tp: Any, value: object) -> None:
    """``value`` is a valid ``tp`` (an SDK request type): strictly, then by pydantic too."""
    errors = _errors(tp, value, "$")
    assert not errors, "\n".join(errors)
    TypeAdapter(tp).validate_python(value)


@pytest.mark.parametrize(
    "wrong",
    [
        {"role": "tool", "tool_call_id": "c"},  # missing content
        {"role": "tool", "tool_call_id": "c", "content": [{"type": "input_text", "text": "x"}]},
        {"role": "tool", "tool_call_id": "c", "content": "x", "name": "exec"},  # unknown key
        {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": 1}]},
    ],
)
def test_the_conformance_check_rejects_wrong_shapes(wrong: dict[str, Any]) -> None:
    with pytest.raises(AssertionError):
        assert_conforms(ChatCompletionToolMessageParam, wrong)


# --- fixtures ------------------------------------------------------------------------------------


def function_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def exec_call(call_id: str, code: str) -> dict[str, Any]:
    return function_call(call_id, "exec", json.dumps({EXEC_CODE_ARGUMENT: code}))


@pytest.fixture
def fake() -> RecordingFakeSession:
    return RecordingFakeSession()


@pytest.fixture
async def chat(fake: RecordingFakeSession) -> AsyncIterator[ChatCompletions]:
    async with CodeMode(sample_registry(), session=fake, clock=clock()) as code_mode:
        yield code_mode.chat_completions


def header(status: str) -> dict[str, Any]:
    return {"type": "text", "text": f"{status}\nWall time 0.5 seconds\nOutput:\n"}


# --- the tool definitions ------------------------------------------------------------------------


def test_tools_are_function_tools_the_sdk_accepts() -> None:
    code_mode = CodeMode(sample_registry())
    exec_tool, wait_tool = code_mode.chat_completions.tools()
    for tool in (exec_tool, wait_tool):
        assert_conforms(ChatCompletionFunctionToolParam, tool)
        assert_conforms(ChatCompletionToolUnionParam, tool)
    assert exec_tool["function"]["name"] == "exec"
    parameters = exec_tool["function"]["parameters"]
    assert parameters["required"] == [EXEC_CODE_ARGUMENT]
    assert parameters["properties"][EXEC_CODE_ARGUMENT]["type"] == "string"
    assert parameters["additionalProperties"] is False
    assert wait_tool["function"]["name"] == "wait"
    assert wait_tool["function"]["parameters"]["required"] == ["cell_id"]


def test_the_function_exec_description_speaks_of_the_code_argument() -> None:
    code_mode = CodeMode(sample_registry())
    description = code_mode.chat_completions.tools()[0]["function"]["description"]
    assert "in the `code` string argument" in description
    # The freeform-only sentences were found and replaced.
    assert "not JSON, not a quoted string" not in description
    assert "custom_tool_call_output" not in description
    assert "### `echo`\nEcho tool" in description
    assert description.count("\n") == code_mode.exec_description().count("\n")


def test_freeform_exec_is_a_custom_tool_with_the_grammar() -> None:
    exec_tool, wait_tool = CodeMode(sample_registry()).chat_completions.tools(freeform=True)
    assert_conforms(ChatCompletionCustomToolParam, exec_tool)
    assert_conforms(ChatCompletionFunctionToolParam, wait_tool)
    assert exec_tool["custom"]["format"]["grammar"]["syntax"] == "lark"


# --- recognising calls ---------------------------------------------------------------------------


SDK_FUNCTION_CALL = ChatCompletionMessageFunctionToolCall.model_validate(
    function_call("c", "wait", '{"cell_id": "1"}')
)


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (exec_call("c", "text(1)"), True),
        (function_call("c", "wait", "{}"), True),
        (SDK_FUNCTION_CALL, True),
        (
            ChatCompletionMessageCustomToolCall.model_validate(
                {"id": "c", "type": "custom", "custom": {"name": "exec", "input": "text(1)"}}
            ),
            True,
        ),
        (function_call("c", "shell", "{}"), False),
        ({"id": "c", "type": "function"}, False),
        # Other APIs' items named exec/wait are not claimed.
        ({"type": "custom_tool_call", "call_id": "c", "name": "exec", "input": "x"}, False),
        ({"type": "function_call", "call_id": "c", "name": "wait", "arguments": "{}"}, False),
        ({"type": "tool_use", "id": "c", "name": "exec", "input": {"code": "x"}}, False),
        ({"role": "assistant", "content": "hi"}, False),
    ],
)
def test_handles_exactly_chat_tool_calls_of_exec_and_wait(call: object, expected: bool) -> None:
    assert ChatCompletions.handles(call) is expected


def test_responses_handles_no_chat_tool_call() -> None:
    assert not CodeMode.handles(exec_call("c", "text(1)"))
    assert not CodeMode.handles(SDK_FUNCTION_CALL)


# --- replies -------------------------------------------------------------------------------------


async def test_exec_reply_is_a_tool_message(
    chat: ChatCompletions, fake: RecordingFakeSession
) -> None:
    reply = await chat.handle(exec_call("call-1", '// @exec: {"yield_time_ms": 5}\ntext(1)'))
    assert reply == ChatReply(
        {
            "role": "tool",
            "tool_call_id": "call-1",
            "content": [header("Script completed"), {"type": "text", "text": "ok"}],
        },
        [],
    )
    assert_conforms(ChatCompletionToolMessageParam, reply.tool_message)
    assert reply.messages() == [reply.tool_message]
    assert fake.executed[0].source == "text(1)"
    assert fake.executed[0].yield_time_ms == 5


async def test_sdk_tool_call_objects_are_accepted(
    chat: ChatCompletions, fake: RecordingFakeSession
) -> None:
    message = ChatCompletionMessage.model_validate(
        {"role": "assistant", "content": None, "tool_calls": [SDK_FUNCTION_CALL.model_dump()]}
    )
    assert message.tool_calls is not None
    (reply,) = await chat.handle_all(message.tool_calls)
    assert reply["tool_call_id"] == "c"
    assert_conforms(ChatCompletionToolMessageParam, reply)
    assert fake.waited[0].cell_id == CellId("1")


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ("{", "failed to parse function arguments: "),
        ('{"source": "text(1)"}', "failed to parse function arguments: expected an object"),
        ('{"code": 1}', "failed to parse function arguments: expected an object"),
        ('["text(1)"]', "failed to parse function arguments: expected an object"),
    ],
)
async def test_bad_exec_arguments_are_the_models_failure(
    chat: ChatCompletions, fake: RecordingFakeSession, arguments: str, message: str
) -> None:
    reply = await chat.handle(function_call("c", "exec", arguments))
    (part,) = reply.tool_message["content"]
    assert part["text"].startswith(message)
    assert_conforms(ChatCompletionToolMessageParam, reply.tool_message)
    assert fake.executed == []


async def test_freeform_calls_are_served_too(
    chat: ChatCompletions, fake: RecordingFakeSession
) -> None:
    call = {"id": "c", "type": "custom", "custom": {"name": "exec", "input": "text(2)"}}
    reply = await chat.handle(call)
    assert fake.executed[0].source == "text(2)"
    assert_conforms(ChatCompletionToolMessageParam, reply.tool_message)
    wait = {"id": "w", "type": "custom", "custom": {"name": "wait", "input": "{}"}}
    refused = await chat.handle(wait)
    assert refused.tool_message["content"] == [
        {"type": "text", "text": "wait expects JSON arguments"}
    ]


async def test_images_go_to_a_user_message_after_all_tool_messages(
    chat: ChatCompletions, fake: RecordingFakeSession
) -> None:
    fake.response = Result(
        CellId("1"),
        [
            InputText("a chart:"),
            InputImage(PNG),
            InputImage("https://example.com/b.png", ImageDetail.ORIGINAL),
            InputAudio("data:audio/wav;base64,UklGRg=="),
        ],
    )
    messages = await chat.handle_all(
        [exec_call("call-1", "image(...)"), function_call("call-2", "wait", '{"cell_id": "9"}')]
    )
    first, second, user = messages
    assert first["content"][0]["text"].startswith("Script completed\n")
    first["content"][0] = header("Script completed")
    assert first == {
        "role": "tool",
        "tool_call_id": "call-1",
        "content": [
            header("Script completed"),
            {"type": "text", "text": "a chart:"},
            {"type": "text", "text": image_placeholder(1)},
            {"type": "text", "text": image_placeholder(2)},
            {"type": "text", "text": AUDIO_PLACEHOLDER},
        ],
    }
    assert second["tool_call_id"] == "call-2"
    assert user == {
        "role": "user",
        "content": [
            {"type": "text", "text": "Images from tool call call-1:"},
            {"type": "image_url", "image_url": {"url": PNG, "detail": "high"}},
            {
                "type": "image_url",
                "image_url": {"url": "https://example.com/b.png", "detail": "original"},
            },
        ],
    }
    for tool_message in (first, second):
        assert_conforms(ChatCompletionToolMessageParam, tool_message)
        assert_conforms(ChatCompletionMessageParam, tool_message)
    assert_conforms(ChatCompletionUserMessageParam, user)
    assert_conforms(ChatCompletionMessageParam, user)


async def test_other_calls_are_programming_errors(
    chat: ChatCompletions, fake: RecordingFakeSession
) -> None:
    with pytest.raises(ValueError, match="not a Chat Completions exec or wait"):
        await chat.handle({"type": "tool_use", "id": "c", "name": "exec", "input": {}})
    with pytest.raises(ValueError, match="`id`"):
        await chat.handle({"type": "function", "function": {"name": "exec", "arguments": "{}"}})
    with pytest.raises(ValueError, match="`arguments`"):
        await chat.handle({"id": "c", "type": "function", "function": {"name": "exec"}})
    assert fake.executed == []


# --- end to end on the embedded runtime ----------------------------------------------------------


async def test_a_scripted_turn_runs_on_the_embedded_runtime() -> None:
    async with CodeMode(sample_registry(), clock=clock()) as code_mode:
        chat = code_mode.chat_completions
        # What a model turn comes back as: an SDK message with tool calls.
        assistant = ChatCompletionMessage.model_validate(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    exec_call(
                        "call-1",
                        '// @exec: {"yield_time_ms": 50}\n'
                        'text(await tools.math__mean({values: [1, 2]})); image("'
                        + PNG
                        + '"); await new Promise(r => setTimeout(r, 300)); text("late")',
                    ),
                    function_call("call-2", "shell", "{}"),
                ],
            }
        )
        assert assistant.tool_calls is not None
        calls = [call for call in assistant.tool_calls if chat.handles(call)]
        assert len(calls) == 1
        started, user = await chat.handle_all(calls)
        assert started["content"] == [
            header("Script running with cell ID 1"),
            {"type": "text", "text": "1.5"},
            {"type": "text", "text": image_placeholder(1)},
        ]
        assert user["content"][1] == {
            "type": "image_url",
            "image_url": {"url": PNG, "detail": "high"},
        }
        finished = await chat.handle(function_call("call-3", "wait", '{"cell_id": "1"}'))
        assert finished.tool_message["content"] == [
            header("Script completed"),
            {"type": "text", "text": "late"},
        ]
        history = [
            {"role": "user", "content": "go"},
            assistant.model_dump(exclude_none=True),
            started,
            user,
            *finished.messages(),
        ]
        for message in history:
            assert_conforms(ChatCompletionMessageParam, message)
