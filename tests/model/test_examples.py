"""The examples run as documented (``python examples/agent_loop.py`` from the checkout root)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(130)
def test_agent_loop_example() -> None:
    result = subprocess.run(
        [sys.executable, "examples/agent_loop.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stderr == ""
    lines = result.stdout.splitlines()
    # The steps, in order: an exec that completes (with a notification and a caught tool
    # failure), an exec that yields, a wait on that cell, and the final answer.
    expected = [
        "-> model: exec call_1",
        "   notify from cell 1: looking up 3 cities",
        "<- custom_tool_call_output call_1",
        "   | Script completed",
        "   | Paris: 18°C, cloudy",
        "   | average: 17.0°C",
        "   | expected failure: tool `weather` failed: ValueError: unknown city 'Atlantis'",
        "-> model: exec call_2",
        "<- custom_tool_call_output call_2",
        "   | Script running with cell ID 2",
        "   | forecast requested",
        "-> model: wait call_3",
        "<- function_call_output call_3",
        "   | Script completed",
        "   | Oslo: rain, clear, rain; today's average was 17.0°C",
        "-> model: message",
        "assistant: Here is what I found. Oslo: rain, clear, rain; today's average was 17.0°C",
    ]
    position = 0
    for line in expected:
        assert line in lines[position:], f"{line!r} missing or out of order in:\n{result.stdout}"
        position = lines.index(line, position) + 1
