"""Fixtures of the TorchTitan plugin tests."""

import math

import pytest
import torch.distributed as dist

from torchtitan_ft.testing import titan_jobs as _jobs


@pytest.fixture
def single_rank_group():
    """A 1-process gloo default group (FSDP on a 1-rank mesh), torn down afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _job_budget(request: pytest.FixtureRequest):
    """Runs of ``_jobs`` wait within this test's pytest timeout; whatever still runs at the
    end is SIGKILLed. The budget ends with the test: a later test of this worker outside
    ``tests/titan`` (tests/testing/test_titan_jobs_log.py) would otherwise wait within this
    one's spent budget."""
    _jobs.RUNS.clear()
    marker = request.node.get_closest_marker("timeout")
    timeout = marker.args[0] if marker and marker.args else request.config.getini("timeout")
    _jobs.set_budget(float(timeout))
    yield
    for run in _jobs.RUNS:
        if run.proc.poll() is None:
            run.sigkill()
        if isinstance(run, _jobs.TrainRun):  # a core it left goes to its dump folder
            run.collect_core()
    _jobs.set_budget(math.inf)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failed test (a timeout too) reports the tail of every run's log, with the start of
    its first fatal error (:meth:`LoggedProcess.excerpt`)."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        for run in _jobs.RUNS:
            title = f"log of {run.name} (exit status {run.returncode})"
            report.sections.append((title, run.excerpt()))
