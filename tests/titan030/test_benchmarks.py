"""The TorchTitan benchmarks' smoke runs on TorchTitan 0.3.0, the release a fresh install has
(tests/test_benchmarks.py runs them on 0.2.2): each launches its jobs through
``torchtitan_ft.titan.releases.job``, which spells the installed release's command line."""

from __future__ import annotations

import pytest

from tests.test_benchmarks import (  # noqa: F401 (collected here, run on 0.3.0)
    _benchmark,
    test_goodput_prints_every_method,
    test_stragglers_titan_row_runs_its_clean_run,
)


@pytest.mark.slow  # three TorchTitan jobs of 3 steps (1, 4 and 2 x 2 processes): minutes
@pytest.mark.multiprocess
@pytest.mark.timeout(900)
def test_titan_step_prints_the_installed_release() -> None:
    out = _benchmark("benchmarks.titan_step", "--steps", "3", "--warmup", "1", timeout=860)
    (row,) = out["results"]
    assert (row["release"], row["dtype"]) == ("0.3.0", "float32")
    assert row["ratio_ft_over_native"] > 0
    assert all(len(row[f"{job}_step_s"]) == 2 for job in ("single", "native", "ft")), row
