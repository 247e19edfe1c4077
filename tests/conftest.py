"""Shared pytest configuration.

Multi-process tests carry the ``multiprocess`` marker; everything binds 127.0.0.1 only (or the
addresses of the test hosts the multi-host tests create). Tests marked ``slow`` repeat behaviour
the default run covers elsewhere in a longer or larger form; they run with ``--full``
(``./run_tests.sh --full``) and are skipped, with that reason, otherwise.
Tests marked ``step_timing`` compare step times within one run; they are scheduled last.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--full",
        action="store_true",
        help="also run the tests marked slow (the full tier; see docs/development.md)",
    )


SERIAL_GROUP = "titan"
"""The xdist group (``./run_tests.sh`` runs two workers with ``--dist loadgroup``) of the tests
that run on one worker, one after the other: the multi-process TorchTitan tests (a job of
2-4 trainers saturates the 2 cores by itself) and the multi-host tests (one test bed of network
namespaces at a time). A test under ``tests/titan`` marked ``light`` (it trains at most one
process, or its processes stop at start-up) is not in it: it runs on either worker, beside the
group."""


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        titan_job = (
            item.nodeid.startswith("tests/titan/")
            and "multiprocess" in item.keywords
            and item.get_closest_marker("light") is None
        )
        if titan_job or "multihost" in item.keywords:
            item.add_marker(pytest.mark.xdist_group(SERIAL_GROUP))
    # Tests that compare step times within a run go last (a stable sort keeps the rest in
    # order): by then the other worker has run out of tests and no longer changes the load
    # in the middle of the comparison.
    items.sort(key=lambda item: "step_timing" in item.keywords)
    if config.getoption("--full"):
        return
    skip = pytest.mark.skip(reason="slow tier: run with ./run_tests.sh --full")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_root_log_handlers() -> Iterator[None]:
    """Removes root-logger handlers a test added (TorchTitan's ``init_logger``, run by
    ``torchtitan_ft.titan.train.main``, adds one bound to the test's captured stderr, which is
    closed afterwards: a later log line from a server thread would fail to write)."""
    before = list(logging.getLogger().handlers)
    yield
    root = logging.getLogger()
    for handler in [h for h in root.handlers if h not in before]:
        root.removeHandler(handler)
