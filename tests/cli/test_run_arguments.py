"""``codemode run``'s numbers out of range: usage errors (status 2) that name the bound."""

from __future__ import annotations

import pytest

from tests.commands import codemode

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("flag", "value", "bound"),
    [
        ("--max-output-tokens", "2147483648", "2147483647 (2^31 - 1"),
        ("--max-output-tokens", "3000000000", "2147483647 (2^31 - 1"),
        ("--yield-ms", "9007199254740992", "9007199254740991 (2^53 - 1"),
        ("--yield-ms", "18446744073709551616", "9007199254740991 (2^53 - 1"),
    ],
    ids=["tokens-just-above", "tokens-far-above", "yield-just-above", "yield-above-u64"],
)
def test_a_flag_above_its_bound_is_a_usage_error(flag: str, value: str, bound: str) -> None:
    # It was "codemode: out of range integral type conversion attempted", status 1.
    done = codemode("run", "-", flag, value, stdin=b'text("hi")')
    assert done.returncode == 2
    assert done.stdout == b""
    message = f"argument {flag}: expected an integer from 0 to {bound}"
    assert message in done.stderr.decode(), done.stderr
    assert f"got '{value}'" in done.stderr.decode()


def test_a_pragma_output_budget_above_what_the_runtime_carries_names_field_and_bound() -> None:
    # The pragma allows up to 2^53 - 1; the request then failed its conversion at the runtime.
    done = codemode("run", "-", stdin=b'// @exec: {"max_output_tokens": 3000000000}\ntext(1)')
    assert done.returncode == 2
    assert done.stderr == (
        b"codemode: exec pragma field `max_output_tokens` must be at most 2147483647 "
        b"(2^31 - 1, what the runtime's protocol carries), got 3000000000\n"
    )
