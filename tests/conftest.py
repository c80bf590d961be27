"""Settings every test needs before anything is imported, and the run's report hooks."""

import os
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import settings

# The runtime forks engine processes with a pre-exec hook; gRPC's fork handlers make such children
# crash while gRPC threads run (codemode.grpc_stubs sets the same default for users).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

# Speed is measured in benchmarks, never asserted: an example may take its time on a machine that
# runs the suite's workers side by side (a deadline would fail it as flaky).
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport() -> Iterator[None]:
    # Tests feed lone surrogates to tools whose failures are logged; pytest-xdist sends a report's
    # captured sections to the controller as UTF-8, and such a section crashed the worker.
    outcome: Any = yield
    report = outcome.get_result()
    report.sections = [
        (title, text.encode("utf-8", "backslashreplace").decode())
        for title, text in report.sections
    ]
