"""Run one scripted Codex turn against :class:`FakeResponses`; print what Codex told the model.

``python -m tests.e2e.codex_run LAYOUT [--v1]`` runs ``LAYOUT/codex exec`` (whose code-mode host is
whatever ``LAYOUT/codex-code-mode-host`` is) with a throw-away ``CODEX_HOME`` pointing it at a
fake Responses server on loopback, and prints one JSON object: the tool outputs Codex sent back
(``outputs``), its exit status and the end of its stderr. ``--v1`` turns Codex's gRPC host
transport off (0.171+ then speaks Protocol V1). Run under ``unshare -rn`` it first brings up the
loopback interface of its new network namespace, where loopback is all there is.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import os
import socket
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any, Final

from tests.e2e.fake_responses import FakeResponses, Step, exec_step, message_step, wait_step

#: A 1x1 PNG.
PNG: Final = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAC"
    "hwGA60e6kgAAAABJRU5ErkJggg=="
)

#: The turn: nested Codex tools, store/load across cells, a thrown error, a yield finished by
#: ``wait``, a missing tool, a terminate, an image, an output over the budget.
STEPS: Final = [
    exec_step('text("hello"); store("k", 41)', "call_1"),
    exec_step(
        'text(String(load("k") + 1)); text(JSON.stringify(await tools.get_goal({}))); '
        'const r = await tools.exec_command({cmd: "echo nested"}); '
        "text(r.output); text(String(r.exit_code))",
        "call_2",
    ),
    exec_step('throw new Error("boom")', "call_3"),
    exec_step(
        '// @exec: {"yield_time_ms": 100}\n'
        'text("before"); await new Promise(r => setTimeout(r, 500)); text("after")',
        "call_4",
    ),
    wait_step("call_5", cell_id="4", yield_time_ms=10_000),
    exec_step("await tools.no_such_tool({})", "call_6"),
    exec_step(
        '// @exec: {"yield_time_ms": 100}\ntext("spin"); await new Promise(() => {})', "call_7"
    ),
    wait_step("call_8", cell_id="6", terminate=True),
    exec_step(f'image("{PNG}"); text("pictured")', "call_9"),
    # Over the default output budget: truncated for the model (by Codex, or by a host that
    # grants 0.171's host-side truncation; codemode's does not, see docs/interop.md).
    exec_step('text("a".repeat(100000)); text("line\\n".repeat(3000))', "call_10"),
    message_step("done"),
]

CONFIG: Final = """\
model = "fake-model"
model_provider = "fake"
approval_policy = "never"
sandbox_mode = "danger-full-access"
check_for_update_on_startup = false

[model_providers.fake]
name = "fake"
base_url = "{base}"
wire_api = "responses"
env_key = "FAKE_API_KEY"
requires_openai_auth = false
supports_websockets = false
request_max_retries = 0
stream_max_retries = 0

[features]
code_mode = true
code_mode_host = true
plugins = false
{extra}
[analytics]
enabled = false
"""

_SIOCGIFFLAGS: Final = 0x8913
_SIOCSIFFLAGS: Final = 0x8914
_IFF_UP: Final = 0x1


def loopback_up() -> None:
    """Bring ``lo`` up (a new network namespace starts with it down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH", b"lo", 0)
        flags = struct.unpack("16sH", fcntl.ioctl(sock, _SIOCGIFFLAGS, request))[1]
        if not flags & _IFF_UP:
            fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | _IFF_UP))


async def run(layout: Path, steps: list[Step], *, v1: bool, timeout: float) -> dict[str, Any]:
    """One ``codex exec`` turn served by ``steps``; what Codex sent back for each call."""
    fake = FakeResponses(steps)
    base = await fake.start()
    with tempfile.TemporaryDirectory() as home, tempfile.TemporaryDirectory() as work:
        extra = "code_mode_host_grpc = false\n" if v1 else ""
        Path(home, "config.toml").write_text(CONFIG.format(base=base, extra=extra))
        environment = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("OPENAI", "CODEX"))
        }
        environment.update(CODEX_HOME=home, FAKE_API_KEY="unused", RUST_LOG="error")
        process = await asyncio.create_subprocess_exec(
            str(layout / "codex"),
            "exec",
            "--skip-git-repo-check",
            "--json",
            "run the cells",
            cwd=work,
            env=environment,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            _, stderr = await asyncio.wait_for(process.communicate(), timeout)
        except TimeoutError:
            process.kill()
            _, stderr = await process.communicate()
        finally:
            await fake.aclose()
    return {
        "returncode": process.returncode,
        "outputs": fake.outputs,
        "requests": len(fake.requests),
        "stderr": stderr.decode(errors="replace")[-4000:],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("layout", type=Path)
    parser.add_argument("--v1", action="store_true")
    parser.add_argument("--timeout", type=float, default=90.0)
    parser.add_argument("--loopback-up", action="store_true")
    args = parser.parse_args()
    if args.loopback_up:
        loopback_up()
    result = asyncio.run(run(args.layout, STEPS, v1=args.v1, timeout=args.timeout))
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
