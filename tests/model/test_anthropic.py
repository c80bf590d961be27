"""``exec``/``wait`` in the Anthropic Messages shape, checked against the ``anthropic`` SDK's types."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from anthropic.types import (
    ContentBlockParam,
    Message,
    MessageParam,
    ToolParam,
    ToolResultBlockParam,
    ToolUnionParam,
    ToolUseBlock,
)

from codemode.model import AnthropicMessages, CodeMode
from codemode.model.anthropic import AUDIO_PLACEHOLDER, image_block
from codemode.protocol.types import CellId, InputAudio, InputImage, InputText, Result
from tests.model.test_chat_completions import PNG, assert_conforms
from tests.model.test_codemode import RecordingFakeSession, clock, sample_registry


def tool_use(block_id: str, name: str, arguments: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": block_id, "name": name, "input": arguments}


def header(status: str) -> dict[str, Any]:
    return {"type": "text", "text": f"{status}\nWall time 0.5 seconds\nOutput:\n"}


@pytest.fixture
def fake() -> RecordingFakeSession:
    return RecordingFakeSession()


@pytest.fixture
async def messages(fake: RecordingFakeSession) -> AsyncIterator[AnthropicMessages]:
    async with CodeMode(sample_registry(), session=fake, clock=clock()) as code_mode:
        yield code_mode.anthropic


def test_the_conformance_check_rejects_wrong_shapes() -> None:
    with pytest.raises(AssertionError):
        assert_conforms(ToolResultBlockParam, {"type": "tool_result"})
    with pytest.raises(AssertionError):
        assert_conforms(
            ToolResultBlockParam,
            {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "input_text"}]},
        )


def test_tools_are_tool_params_the_sdk_accepts() -> None:
    code_mode = CodeMode(sample_registry())
    exec_tool, wait_tool = code_mode.anthropic.tools()
    for tool in (exec_tool, wait_tool):
        assert_conforms(ToolParam, tool)
        assert_conforms(ToolUnionParam, tool)
    assert exec_tool["name"] == "exec"
    assert exec_tool["description"] == code_mode.exec_function_description()
    assert exec_tool["input_schema"]["required"] == ["code"]
    assert wait_tool["name"] == "wait"
    assert wait_tool["input_schema"]["required"] == ["cell_id"]


SDK_BLOCK = ToolUseBlock.model_validate(tool_use("toolu_1", "wait", {"cell_id": "1"}))


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        (tool_use("t", "exec", {"code": "text(1)"}), True),
        (SDK_BLOCK, True),
        (tool_use("t", "shell", {}), False),
        ({"type": "text", "text": "exec"}, False),
        ({"type": "custom_tool_call", "call_id": "c", "name": "exec", "input": "x"}, False),
        ({"id": "c", "type": "function", "function": {"name": "exec", "arguments": "{}"}}, False),
    ],
)
def test_handles_exactly_tool_use_blocks_of_exec_and_wait(block: object, expected: bool) -> None:
    assert AnthropicMessages.handles(block) is expected


def test_responses_and_chat_claim_no_tool_use_block() -> None:
    # The issue: CodeMode.handles claimed a ToolUseBlock, then CodeMode.handle raised.
    assert not CodeMode.handles(SDK_BLOCK)
    assert not CodeMode.handles(tool_use("t", "exec", {"code": "x"}))
    assert not CodeMode(sample_registry()).chat_completions.handles(SDK_BLOCK)


async def test_exec_reply_is_a_tool_result(
    messages: AnthropicMessages, fake: RecordingFakeSession
) -> None:
    result = await messages.handle(tool_use("toolu_1", "exec", {"code": "text(1)"}))
    assert result == {
        "type": "tool_result",
        "tool_use_id": "toolu_1",
        "content": [header("Script completed"), {"type": "text", "text": "ok"}],
    }
    assert_conforms(ToolResultBlockParam, result)
    assert_conforms(ContentBlockParam, result)
    assert fake.executed[0].source == "text(1)"


async def test_sdk_blocks_and_wait(messages: AnthropicMessages, fake: RecordingFakeSession) -> None:
    (result,) = await messages.handle_all([SDK_BLOCK])
    assert result["tool_use_id"] == "toolu_1"
    assert_conforms(ToolResultBlockParam, result)
    assert fake.waited[0].cell_id == CellId("1")


@pytest.mark.parametrize(
    ("name", "arguments", "message"),
    [
        ("exec", {"source": "text(1)"}, "failed to parse function arguments: expected an object"),
        ("exec", {"code": 3}, "failed to parse function arguments: expected an object"),
        ("wait", {"yield_time_ms": 5}, "failed to parse function arguments: "),
        ("wait", {"cell_id": "1", "max_tokens": -1}, "failed to parse function arguments: "),
    ],
)
async def test_bad_inputs_are_the_models_error(
    messages: AnthropicMessages,
    fake: RecordingFakeSession,
    name: str,
    arguments: dict[str, Any],
    message: str,
) -> None:
    result = await messages.handle(tool_use("t", name, arguments))
    assert result["is_error"] is True
    (block,) = result["content"]
    assert block["text"].startswith(message)
    assert_conforms(ToolResultBlockParam, result)
    assert fake.executed == []
    assert fake.waited == []


async def test_failed_script_sets_is_error_and_images_become_image_blocks(
    messages: AnthropicMessages, fake: RecordingFakeSession
) -> None:
    fake.response = Result(
        CellId("1"),
        [
            InputText(""),
            InputImage(PNG),
            InputImage("https://example.com/b.png"),
            InputImage("data:image/tiff;base64,AAAA"),
            InputAudio("data:audio/wav;base64,UklGRg=="),
        ],
        "boom",
    )
    result = await messages.handle(tool_use("t", "exec", {"code": "x"}))
    assert result == {
        "type": "tool_result",
        "tool_use_id": "t",
        "content": [
            header("Script failed"),
            {
                "type": "image",
                "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
            },
            {"type": "image", "source": {"type": "url", "url": "https://example.com/b.png"}},
            {"type": "text", "text": "[image omitted: unsupported source data:image/tiff;base64]"},
            {"type": "text", "text": AUDIO_PLACEHOLDER},
            {"type": "text", "text": "Script error:\nboom"},
        ],
        "is_error": True,
    }
    assert_conforms(ToolResultBlockParam, result)


@pytest.mark.parametrize(
    "url",
    ["data:image/png,raw", "data:image/bmp;base64,AA", "ftp://x/y.png", "no-scheme", "data:"],
)
def test_unsupported_image_sources(url: str) -> None:
    assert image_block(url) is None


def test_data_url_media_type_is_case_insensitive() -> None:
    block = image_block("DATA:Image/JPEG;BASE64,/9j/")
    assert block == {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/jpeg", "data": "/9j/"},
    }


async def test_other_blocks_are_programming_errors(
    messages: AnthropicMessages, fake: RecordingFakeSession
) -> None:
    with pytest.raises(ValueError, match="not an Anthropic exec or wait"):
        await messages.handle({"type": "function_call", "name": "exec", "call_id": "c"})
    with pytest.raises(ValueError, match="`id`"):
        await messages.handle({"type": "tool_use", "name": "exec", "input": {"code": "x"}})
    assert fake.executed == []


async def test_a_scripted_turn_runs_on_the_embedded_runtime() -> None:
    async with CodeMode(sample_registry(), clock=clock()) as code_mode:
        tools = code_mode.anthropic
        # What a model turn comes back as: an SDK Message with tool_use blocks.
        reply = Message.model_validate(
            {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "model": "scripted",
                "stop_reason": "tool_use",
                "stop_sequence": None,
                "usage": {"input_tokens": 1, "output_tokens": 1},
                "content": [
                    {"type": "text", "text": "Let me compute."},
                    tool_use(
                        "toolu_1",
                        "exec",
                        {
                            "code": '// @exec: {"yield_time_ms": 50}\n'
                            "text(await tools.math__mean({values: [1, 2]})); "
                            f'image("{PNG}"); '
                            'await new Promise(r => setTimeout(r, 300)); text("late")'
                        },
                    ),
                    tool_use("toolu_2", "shell", {}),
                ],
            }
        )
        calls = [block for block in reply.content if tools.handles(block)]
        assert len(calls) == 1
        (started,) = await tools.handle_all(calls)
        assert started["content"] == [
            header("Script running with cell ID 1"),
            {"type": "text", "text": "1.5"},
            {
                "type": "image",
                "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
            },
        ]
        assert "is_error" not in started
        finished = await tools.handle(tool_use("toolu_3", "wait", {"cell_id": "1"}))
        assert finished["content"] == [header("Script completed"), {"type": "text", "text": "late"}]
        history = [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [block.model_dump() for block in reply.content]},
            {"role": "user", "content": [started]},
            {"role": "assistant", "content": [tool_use("toolu_3", "wait", {"cell_id": "1"})]},
            {"role": "user", "content": [finished]},
        ]
        for message in history[2:]:
            assert_conforms(MessageParam, message)
