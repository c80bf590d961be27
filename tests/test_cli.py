"""The ``codemode`` command line, run as a real subprocess."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from codemode.model.toolfile import load_tool_file
from codemode.model.typescript import render_tool_declaration
from codemode.protocol.v1.messages import OperationCancel
from codemode.runtime.session import DEFAULT_MAX_HELD_CHARS, DEFAULT_TOTAL_MEMORY_CAP_BYTES
from tests.commands import codemode
from tests.wire import frame, hello, payloads


def test_wire_validate_prints_the_canonical_encoding() -> None:
    hello = (
        b'{ "optionalCapabilities": ["b", "a"], "type": "connection/hello",'
        b' "supportedVersions": [1], "requiredCapabilities": [] }'
    )
    result = codemode("wire", "validate", "--type", "ClientToHost", stdin=hello)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        b'{"type":"connection/hello","supportedVersions":[1],'
        b'"requiredCapabilities":[],"optionalCapabilities":["a","b"]}\n'
    )


def test_wire_validate_reports_the_error() -> None:
    result = codemode(
        "wire",
        "validate",
        "--type",
        "ClientToHost",
        stdin=b'{"type":"operation/cancel","id":1,"x":1}',
    )
    assert result.returncode == 1
    assert result.stdout == b""
    assert b"unknown field `x`" in result.stderr


def test_wire_validate_domain_type_applies_the_conversion() -> None:
    request = (
        b'{"tool_call_id":"c","enabled_tools":[],"source":"x",'
        b'"yield_time_ms":null,"max_output_tokens":-1}'
    )
    result = codemode("wire", "validate", "--type", "ExecuteRequest", stdin=request)
    assert result.returncode == 1
    assert result.stderr.strip() == b"out of range integral type conversion attempted"
    result = codemode("wire", "validate", "--type", "WireExecuteRequest", stdin=request)
    assert result.returncode == 0


def test_wire_validate_unknown_type_is_a_usage_error() -> None:
    assert codemode("wire", "validate", "--type", "Nope").returncode == 2


def test_wire_frames_prints_messages_and_the_first_framing_error(tmp_path: Path) -> None:
    capture = tmp_path / "capture.bin"
    first = frame({"type": "operation/cancel", "id": 1})
    second = frame({"type": "delegate/cancel", "id": 2})
    capture.write_bytes(first + b"\x03\x00\x00\x00abc" + second + b"\x01\x00")
    result = codemode("wire", "frames", str(capture))
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        b'{"type":"operation/cancel","id":1}',
        b'{"type":"delegate/cancel","id":2}',
    ]
    errors = result.stderr.decode().splitlines()
    assert errors[0].startswith(f"frame at byte offset {len(first)}: failed to decode")
    offset = len(first) + 7 + len(second)
    assert errors[1] == (
        f"frame at byte offset {offset}: code-mode IPC frame length prefix truncated after 2 bytes"
    )


def test_wire_frames_reads_stdin() -> None:
    data = frame({"type": "cell/closed", "sessionId": "s", "cellId": "1"})
    result = codemode("wire", "frames", "-", stdin=data)
    assert result.returncode == 0
    assert result.stdout == b'{"type":"cell/closed","sessionId":"s","cellId":"1"}\n'


# -- codemode run ---------------------------------------------------------------------------------

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_run_example_orchestration() -> None:
    result = codemode(
        "run", str(EXAMPLES / "orchestrate.js"), "--tools", str(EXAMPLES / "tools.py")
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout.decode()
    assert out.startswith("Script completed\nWall time ")
    assert "average: 17.0°C" in out
    assert "expected failure: tool `weather` failed: ValueError: unknown city 'atlantis'" in out
    assert "[image: data:image/png;base64," in out
    assert b"notify: fetching weather for 3 cities" in result.stderr


def test_run_json_prints_one_wire_response() -> None:
    result = codemode(
        "run", str(EXAMPLES / "orchestrate.js"), "--tools", str(EXAMPLES / "tools.py"), "--json"
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 1
    body = json.loads(lines[0])["Result"]
    assert body["error_text"] is None
    assert body["content_items"][0] == {"type": "input_text", "text": "paris: 18°C, cloudy"}
    assert body["content_items"][-1]["type"] == "input_image"


def test_run_script_error_exits_1() -> None:
    result = codemode("run", "-", "--json", stdin=b'text("partial"); throw "boom"')
    assert result.returncode == 1
    assert json.loads(result.stdout) == {
        "Result": {
            "cell_id": "1",
            "content_items": [{"type": "input_text", "text": "partial"}],
            "error_text": "boom",
        }
    }


def test_run_waits_on_a_yielding_cell_until_it_completes() -> None:
    # 1,350 ms: between two 300 ms observations, so that "b" and the completion are observed
    # together (at 1,500 the timer raced the fifth observation's end).
    source = b'text("a"); await new Promise(r => setTimeout(r, 1350)); text("b")'
    result = codemode("run", "-", "--yield-ms", "300", stdin=source)
    assert result.returncode == 0, result.stderr
    out = result.stdout.decode()
    assert (
        out.index("Script running with cell ID 1")
        < out.index("\na\n")
        < out.index("Script completed")
    )
    assert out.rstrip().endswith("b")
    merged = codemode("run", "-", "--yield-ms", "300", "--json", stdin=source)
    items = json.loads(merged.stdout)["Result"]["content_items"]
    assert [item["text"] for item in items] == ["a", "b"]


def test_run_timeout_terminates_a_cell_that_runs_on() -> None:
    started = time.monotonic()
    result = codemode("run", "-", "--timeout", "1", stdin=b'text("a"); while (true) {}')
    assert result.returncode == 124, result.stderr
    assert time.monotonic() - started < 15  # stopped at the deadline, not waited on for ever
    out = result.stdout.decode()
    assert out.index("\na\n") < out.index("Script terminated")
    assert b"terminated after --timeout 1 s" in result.stderr
    # A cell that completes in time is not affected; --json still prints one response.
    quick = codemode("run", "-", "--timeout", "30", "--json", stdin=b'text("ok")')
    assert quick.returncode == 0, quick.stderr
    assert json.loads(quick.stdout)["Result"]["content_items"][0]["text"] == "ok"
    assert codemode("run", "-", "--timeout", "0", stdin=b"").returncode == 2


def test_run_wall_time_counts_from_the_last_response_printed() -> None:
    # A silent yield prints nothing: the terminated loop ran the whole second, not 0.0 s.
    result = codemode("run", "-", "--timeout", "1", "--yield-ms", "200", stdin=b"while (true) {}")
    assert result.returncode == 124, result.stderr
    wall = re.search(rb"Script terminated\nWall time ([0-9.]+) seconds", result.stdout)
    assert wall is not None, result.stdout
    assert float(wall.group(1)) >= 0.9


def test_run_pragma_is_honoured() -> None:
    cell = b'text("early"); await new Promise(r => setTimeout(r, 1500)); text("done")'
    pragma = codemode("run", "-", stdin=b'// @exec: {"yield_time_ms": 300}\n' + cell)
    assert pragma.returncode == 0, pragma.stderr
    out = pragma.stdout.decode()
    assert out.index("Script running with cell ID 1") < out.index("early") < out.index("done")
    plain = codemode("run", "-", stdin=cell)  # default yield time: one observation
    assert b"Script running" not in plain.stdout
    assert plain.stdout.rstrip().endswith(b"done")


def test_run_plain_and_decorated_tools(tmp_path: Path) -> None:
    tools = tmp_path / "tools.py"
    tools.write_text(
        "from codemode.model import tool\n"
        "def double(n: int) -> dict[str, int]:\n    return {'value': n * 2}\n"
        "async def fails():\n    raise RuntimeError('nope')\n"
        "def add(a: int, b: int) -> int:\n    'Add two numbers.'\n    return a + b\n"
        "@tool(namespace='math')\ndef mean(values: list[float]) -> float:\n"
        "    return sum(values) / len(values)\n"
        "def _private(args):\n    return 1\n"
    )
    source = (
        b"text(JSON.stringify(await tools.double({n: 21})));"
        b"text(String(await tools.add({a: 1, b: 2})));"
        b"try { await tools.fails({}) } catch (e) { text(e) }"
        b"try { await tools.add({a: 'x', b: 2}) } catch (e) { text(e) }"
        b"text(typeof tools._private);"
        b"text(String(await tools.math__mean({values: [1, 2]})))"
    )
    result = codemode("run", "-", "--tools", str(tools), "--json", stdin=source)
    assert result.returncode == 0, result.stderr
    texts = [item["text"] for item in json.loads(result.stdout)["Result"]["content_items"]]
    assert texts[0] == '{"value":42}'
    assert texts[1] == "3"
    assert texts[2] == "tool `fails` failed: RuntimeError: nope"
    assert texts[3].startswith("invalid arguments for tool `add`: ")
    assert texts[4] == "undefined"
    assert texts[5] == "1.5"


def test_a_tool_file_function_is_declared_by_its_hints(tmp_path: Path) -> None:
    tools = tmp_path / "tools.py"
    tools.write_text("def add(a: int, b: int) -> int:\n    'Add.'\n    return a + b\n")
    (definition,) = load_tool_file(tools).definitions()
    assert (
        render_tool_declaration(definition)
        == "add(args: { a: number; b: number; }): Promise<number>;"
    )


def test_run_describe_prints_what_the_model_is_told_about_the_tools(tmp_path: Path) -> None:
    tools = tmp_path / "tools.py"
    tools.write_text("def add(a: int, b: int) -> int:\n    'Add.'\n    return a + b\n")
    result = codemode("run", "--describe", "--tools", str(tools))
    assert result.returncode == 0, result.stderr
    assert b"add(args: { a: number; b: number; }): Promise<number>;" in result.stdout
    assert b"yield_control()" in result.stdout  # the whole exec description, helpers included


def test_run_without_a_file_is_a_usage_error() -> None:
    result = codemode("run")
    assert result.returncode == 2
    assert b"run needs FILE" in result.stderr


def test_an_uncaught_tool_failure_shows_the_line_that_called_it(tmp_path: Path) -> None:
    tools = tmp_path / "tools.py"
    tools.write_text("def fail() -> None:\n    raise RuntimeError('nope')\n")
    source = b"// @exec: {}\ntext(1);\nawait tools.fail({});\n"
    result = codemode("run", "-", "--tools", str(tools), stdin=source)
    assert result.returncode == 1
    assert result.stdout.endswith(
        b"Script error:\ntool `fail` failed: RuntimeError: nope\n    at tools.fail (exec_main.mjs:3:13)\n"
    )


def test_a_tool_file_function_that_cannot_be_a_tool_is_named(tmp_path: Path) -> None:
    tools = tmp_path / "tools.py"
    tools.write_text("def spread(*values: int) -> int:\n    return 0\n")
    done = codemode("run", "-", "--tools", str(tools), stdin=b"text(1)")
    assert done.returncode == 2
    assert b"cannot use spread of " in done.stderr
    assert b"tool `spread`: *args parameters are not supported" in done.stderr


def test_run_usage_errors_exit_2(tmp_path: Path) -> None:
    assert codemode("run", str(tmp_path / "missing.js")).returncode == 2
    pragma = codemode("run", "-", stdin=b'// @exec: {"nope": 1}\ntext(1)')
    assert pragma.returncode == 2
    assert b"exec pragma only supports" in pragma.stderr
    assert codemode("run", "-", "--yield-ms", "-5", stdin=b"text(1)").returncode == 2
    assert codemode("run", "-", "--tools", str(tmp_path / "none.py"), stdin=b"1").returncode == 2


def test_doctor_lists_the_confinement_layers() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "codemode", "doctor"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "isolated-vm 7.0.1:" in done.stdout
    for layer in ("node-permission", "landlock-fs", "landlock-net", "seccomp"):
        assert f"  {layer}: " in done.stdout
    assert f"--total-memory-cap {DEFAULT_TOTAL_MEMORY_CAP_BYTES}," in done.stdout
    assert f"--max-held-chars {DEFAULT_MAX_HELD_CHARS}\n" in done.stdout


def test_host_listen_stdio_is_the_same_as_stdio() -> None:
    for flags in (("--listen", "stdio"), ("--stdio",), ("--stdio", "--listen", "stdio")):
        done = codemode("host", *flags, stdin=frame(hello(())))
        assert done.returncode == 0, (flags, done.stderr)
        (payload,) = payloads(done.stdout)
        ready = json.loads(payload)
        assert (ready["type"], ready["selectedVersion"]) == ("connection/ready", 1), flags


def test_host_other_listen_addresses_are_usage_errors() -> None:
    for address in ("stdio://", "grpc://127.0.0.1", "ws://127.0.0.1", "ws://127.0.0.1:0?x=1"):
        done = codemode("host", "--listen", address)
        assert done.returncode == 2, address
        assert done.stdout == b""
        assert f"codemode host: --listen {address}: ".encode() in done.stderr
    unknown = codemode("host", "--listen", "http://127.0.0.1:0")
    assert unknown.returncode == 2
    assert unknown.stderr.endswith(
        b"expected stdio, ws://ADDR:PORT[/PATH], grpc://ADDR:PORT or grpc+stdio://\n"
    )
    missing = codemode("host")
    assert missing.returncode == 2
    assert b"--stdio or --listen ADDRESS is required" in missing.stderr


def test_host_durations_are_finite_seconds_from_zero() -> None:
    flags = ("--ping-interval", "--ping-timeout", "--shutdown-grace", "--min-client-ping-interval")
    for flag in flags:
        for value in ("nan", "inf", "-1", "soon"):
            done = codemode("host", "--listen", "ws://127.0.0.1:0", flag, value)
            assert done.returncode == 2, (flag, value)
            assert done.stdout == b""
            assert f"argument {flag}: expected a number of seconds".encode() in done.stderr


def test_host_refuses_a_public_address_without_a_token() -> None:
    done = codemode("host", "--listen", "ws://0.0.0.0:0")
    assert done.returncode == 2
    assert done.stdout == b""
    assert b"refusing to listen on 0.0.0.0 without a token" in done.stderr


def test_version() -> None:
    done = codemode("--version")
    assert done.returncode == 0
    assert re.fullmatch(rb"codemode \d+\.\d+\.\d+\S*\n", done.stdout), done.stdout


def test_a_reader_that_stops_early_is_not_an_error(tmp_path: Path) -> None:
    capture = tmp_path / "capture.bin"
    capture.write_bytes(b"".join(frame(OperationCancel(n)) for n in range(1, 20_001)))
    command = [sys.executable, "-m", "codemode", "wire", "frames", str(capture)]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as child:
        assert child.stdout is not None and child.stderr is not None
        assert child.stdout.readline() == b'{"type":"operation/cancel","id":1}\n'
        child.stdout.close()  # like `| head -1`
        errors = child.stderr.read()
        assert child.wait(timeout=60) == 0
    assert errors == b""


def test_error_lines_count_the_pragma_line(tmp_path: Path) -> None:
    cell = tmp_path / "cell.js"
    cell.write_text('// @exec: {"yield_time_ms": 5000}\ntext(1);\nconst x = ;\n')
    done = codemode("run", str(cell))
    assert done.returncode == 1
    assert b"SyntaxError: Unexpected token ';' (exec_main.mjs:3:11)" in done.stdout, done.stdout


def test_host_listens_on_grpc_until_sigterm() -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc  # type: ignore[import-untyped, unused-ignore]

    command = [sys.executable, "-m", "codemode", "host", "--listen", "grpc://127.0.0.1:0"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as child:
        assert child.stdout is not None and child.stderr is not None
        url = child.stdout.readline().decode().strip()
        assert re.fullmatch(r"grpc://127\.0\.0\.1:\d+", url), url
        with grpc.insecure_channel(url.removeprefix("grpc://")) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            answer = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=30) == 0
        assert b"event=listening url=grpc://127.0.0.1:" in child.stderr.read()


def test_host_bounds_grpc_sessions() -> None:
    import grpc

    from codemode.grpc_stubs import v1_pb2_grpc
    from codemode.protocol.grpc import v1_pb2 as pb

    command = [
        *(sys.executable, "-m", "codemode", "host", "--listen", "grpc://127.0.0.1:0"),
        *("--max-sessions", "1"),
    ]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) as child:
        assert child.stdout is not None
        url = child.stdout.readline().decode().strip()
        try:
            with grpc.insecure_channel(url.removeprefix("grpc://")) as channel:
                stub = v1_pb2_grpc.CodeModeHostStub(channel)
                first = stub.OpenSession(pb.OpenSessionRequest(), timeout=30)
                assert next(first).WhichOneof("event") == "opened"
                second = stub.OpenSession(pb.OpenSessionRequest(), timeout=30)
                with pytest.raises(grpc.RpcError) as caught:
                    next(second)
                assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                first.cancel()
        finally:
            child.send_signal(signal.SIGTERM)
            assert child.wait(timeout=30) == 0


def test_host_refuses_a_public_grpc_address() -> None:
    done = codemode("host", "--listen", "grpc://0.0.0.0:0")
    assert done.returncode == 2
    assert b"refusing to listen on 0.0.0.0 over gRPC" in done.stderr
