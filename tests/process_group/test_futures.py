"""``torchtitan_ft.process_group.futures``: a future with a deadline."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch

from torchtitan_ft.process_group.futures import future_with_timeout


def test_future_with_timeout() -> None:
    ok: torch.futures.Future[int] = torch.futures.Future()
    wrapped = future_with_timeout(ok, timedelta(seconds=5))
    ok.set_result(3)
    assert wrapped.wait() == 3

    failing: torch.futures.Future[int] = torch.futures.Future()
    wrapped = future_with_timeout(failing, timedelta(seconds=5))
    failing.set_exception(ValueError("boom"))
    with pytest.raises(ValueError, match="boom"):
        wrapped.wait()

    never: torch.futures.Future[int] = torch.futures.Future()
    start = time.monotonic()
    wrapped = future_with_timeout(never, timedelta(milliseconds=50))
    with pytest.raises(TimeoutError):
        wrapped.wait()
    assert time.monotonic() - start < 2
    never.set_result(1)  # late completion is ignored
