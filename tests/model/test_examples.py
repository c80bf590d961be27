"""The examples run as documented (``python examples/agent_loop.py`` from the checkout root)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# Per model API shape: the example, the reply lines of an exec and a wait call.
_SHAPES = {
    "responses": (
        "agent_loop.py",
        "call_",
        "<- custom_tool_call_output",
        "<- function_call_output",
    ),
    "chat_completions": ("agent_loop_chat.py", "call_", "<- tool", "<- tool"),
    "anthropic": ("agent_loop_anthropic.py", "toolu_", "<- tool_result", "<- tool_result"),
}


@pytest.mark.timeout(130)
@pytest.mark.parametrize("shape", list(_SHAPES))
def test_agent_loop_example(shape: str) -> None:
    example, call, exec_reply, wait_reply = _SHAPES[shape]
    result = subprocess.run(
        [sys.executable, f"examples/{example}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # codemode logs nowhere unless the application configures logging (a NullHandler).
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    # The steps, in order: an exec that completes (with a notification and a caught tool
    # failure), an exec that yields, a wait on that cell, and the final answer.
    expected = [
        f"-> model: exec {call}1",
        "   notify from cell 1: looking up 3 cities",
        f"{exec_reply} {call}1",
        "   | Script completed",
        "   | Paris: 18°C, cloudy",
        "   | average: 17.0°C",
        "   | expected failure: tool `weather` failed: ValueError: unknown city 'Atlantis'",
        f"-> model: exec {call}2",
        f"{exec_reply} {call}2",
        "   | Script running with cell ID 2",
        "   | forecast requested",
        f"-> model: wait {call}3",
        f"{wait_reply} {call}3",
        "   | Script completed",
        "   | Oslo: rain, clear, rain; today's average was 17.0°C",
        "-> model: message",
        "assistant: Here is what I found. Oslo: rain, clear, rain; today's average was 17.0°C",
    ]
    position = 0
    for line in expected:
        assert line in lines[position:], f"{line!r} missing or out of order in:\n{result.stdout}"
        position = lines.index(line, position) + 1
