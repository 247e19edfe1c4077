"""``testing.cpulimit``: the duty cycle on request, and a process left running when lifted."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from torchtitan_ft.testing.cpulimit import CpuLimit


def test_a_duty_cycle_on_request_stops_and_continues_the_process() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        limit = CpuLimit("duty", [proc.pid], 0.1, duty_cycle=True)
        assert limit.mechanism == "duty cycle"
        stopped = False
        deadline = time.monotonic() + 5
        while not stopped and time.monotonic() < deadline:  # stopped 90% of the time
            with open(f"/proc/{proc.pid}/stat") as f:
                stopped = f.read().rsplit(")", 1)[1].split()[0] == "T"
        limit.close()
        assert stopped
        time.sleep(0.1)
        with open(f"/proc/{proc.pid}/stat") as f:
            assert f.read().rsplit(")", 1)[1].split()[0] != "T"  # continued when lifted
    finally:
        proc.kill()
        proc.wait()


def test_a_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="cpus must be > 0, got 0"):
        CpuLimit("bad", [], 0, duty_cycle=True)
