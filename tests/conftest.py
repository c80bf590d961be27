"""Settings every test needs before anything is imported, and the run's report hooks."""

import os
import signal
from collections.abc import Generator

import pytest
from hypothesis import settings

# The runtime forks engine processes with a pre-exec hook; gRPC's fork handlers make such children
# crash while gRPC threads run (codemode.grpc_stubs sets the same default for users).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

# A shell starts a background job with SIGINT ignored, and an ignored signal stays ignored in
# every program the job starts: the tests that interrupt a `codemode run` child would wait in
# vain. A handler of this process's own is reset to the default in each child instead.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Speed is measured in benchmarks, never asserted: an example may take its time on a machine that
# runs the suite's workers side by side (a deadline would fail it as flaky).
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport() -> Generator[None, pytest.TestReport, pytest.TestReport]:
    # Tests feed lone surrogates to tools whose failures are logged; pytest-xdist sends a report
    # to the controller as UTF-8, and such a captured section (or failure) crashed the worker.
    report = yield
    report.sections = [(title, _utf8(text)) for title, text in report.sections]
    if report.longrepr is not None and not isinstance(report.longrepr, tuple):
        text = str(report.longrepr)
        escaped = _utf8(text)
        if escaped != text:
            report.longrepr = escaped
    return report


def _utf8(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode()
