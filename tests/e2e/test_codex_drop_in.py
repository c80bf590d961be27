"""The released Codex CLI runs its cells on codemode: same tool outputs as on the upstream host.

For each pinned release (``tests/upstream.py``: 0.149.0, which starts its host with no arguments
and speaks Protocol V1, and 0.171.0, which starts it with ``--listen grpc+stdio://``; 0.171.0 is
also run with its gRPC transport off, when it speaks the latest V1 revision) one scripted turn
(``tests/e2e/codex_run.py``) runs twice: with the upstream host next to ``codex``, and in a layout
made by ``codemode codex link``. The tool outputs Codex returns to the model must be identical,
wall times aside. Where unprivileged user namespaces work, each turn runs under ``unshare -rn``:
only loopback exists. Skipped when the binaries cannot be fetched.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import upstream

ROOT = Path(__file__).resolve().parents[2]
WALL_TIME = re.compile(r"Wall time \d+(?:\.\d+)? seconds")


def _isolated() -> list[str]:
    """``unshare -rn`` when it works here (a network namespace with loopback only), else []."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return []
    done = subprocess.run([unshare, "-rn", "true"], check=False, capture_output=True, timeout=10)
    return [unshare, "-rn"] if done.returncode == 0 else []


def _place(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _turn(layout: Path, *, v1: bool) -> dict[str, Any]:
    isolated = _isolated()
    command = [*isolated, sys.executable, "-m", "tests.e2e.codex_run", str(layout)]
    if isolated:
        command.append("--loopback-up")
    if v1:
        command.append("--v1")
    done = subprocess.run(command, cwd=ROOT, capture_output=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    result: dict[str, Any] = json.loads(done.stdout)
    assert result["returncode"] == 0, result["stderr"]
    return result


def _normalised(outputs: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    return [
        (call_id, json.loads(WALL_TIME.sub("Wall time N seconds", json.dumps(output))))
        for call_id, output in outputs
    ]


def _texts(output: Any) -> str:
    if isinstance(output, str):
        return output
    return "\n".join(item.get("text", item.get("image_url", "")) for item in output)


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("version", "v1"),
    [("0.149.0", False), ("0.171.0", False), ("0.171.0", True)],
    ids=["0.149.0", "0.171.0-grpc", "0.171.0-v1"],
)
def test_codex_returns_the_same_tool_outputs_on_codemode(
    version: str, v1: bool, tmp_path_factory: pytest.TempPathFactory
) -> None:
    codex, host = upstream.upstream_codex(version), upstream.upstream_host(version)
    if codex is None or host is None:
        pytest.skip(
            upstream.unavailable_reason(version, "codex") or upstream.unavailable_reason(version)
        )
    # Next to the cache, so that hard links work (the binaries are 60-300 MB).
    base = Path(tmp_path_factory.mktemp("codex"))
    reference = base / "upstream"
    reference.mkdir()
    _place(codex, reference / "codex")
    _place(host, reference / "codex-code-mode-host")
    ours = base / "codemode"
    linked = subprocess.run(
        [sys.executable, "-m", "codemode", "codex", "link", str(ours), "--codex", str(codex)],
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert linked.returncode == 0, linked.stderr

    expected = _normalised(_turn(reference, v1=v1)["outputs"])
    got = _normalised(_turn(ours, v1=v1)["outputs"])

    # The turn did what it should on the reference host, so that equality means something.
    texts = {call_id: _texts(output) for call_id, output in expected}
    assert [call_id for call_id, _ in expected] == [f"call_{n}" for n in range(1, 11)]
    assert "hello" in texts["call_1"]
    assert "42" in texts["call_2"] and "nested" in texts["call_2"]
    assert "Error: boom" in texts["call_3"]
    assert "Script running with cell ID 4" in texts["call_4"] and "after" in texts["call_5"]
    assert "no_such_tool is not a function" in texts["call_6"]
    assert "spin" in texts["call_7"] and "Script terminated" in texts["call_8"]
    assert "data:image/png;base64," in texts["call_9"]
    assert "Warning: truncated output (original token count: " in texts["call_10"]
    assert got == expected

    removed = subprocess.run(
        [sys.executable, "-m", "codemode", "codex", "unlink", str(ours)],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert removed.returncode == 0, removed.stderr
    assert not ours.exists()
    assert codex.is_file()  # the original is untouched
