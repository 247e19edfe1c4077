"""Shared pytest configuration.

Multi-process tests carry the ``multiprocess`` marker; everything binds 127.0.0.1 only (or the
addresses of the test hosts the multi-host tests create). Tests marked ``slow`` repeat behaviour
the default run covers elsewhere in a longer or larger form; they run with ``--full``
(``./run_tests.sh --full``) and are skipped, with that reason, otherwise.
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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
