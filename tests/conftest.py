"""Shared pytest configuration.

Multi-process tests carry the ``multiprocess`` marker; everything binds 127.0.0.1 only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


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
