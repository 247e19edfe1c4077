"""``testing.cpulimit``: the duty cycle on request, a process left running when lifted, and a
cgroup made under the caller's own with the top CPU weight."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from torchtitan_ft.testing.cpulimit import V1_SHARES, V2_WEIGHT, CpuLimit, own_cgroup


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


@pytest.mark.parametrize(
    ("text", "v2", "expected"),
    [
        ("0::/user.slice/session-1.scope\n", True, "/user.slice/session-1.scope"),
        ("0::/\n", True, "/"),
        ("4:memory:/a\n2:cpu,cpuacct:/bench_prio\n0::/\n", False, "/bench_prio"),
        ("1:cpu:/\n0::/\n", False, "/"),
        ("3:cpuset:/x\n", False, "/"),  # no cpu controller line: the root
        ("1:cpu:/v1only\n", True, "/"),  # no v2 line
    ],
)
def test_own_cgroup_reads_the_cpu_controller_line(text: str, v2: bool, expected: str) -> None:
    assert own_cgroup(text, v2) == expected


def test_a_limit_is_made_under_the_callers_cgroup_with_the_top_weight() -> None:
    """A process inside a limit makes its own limit inside that one (a run under a capped,
    prioritised cgroup keeps its groups inside it), weighted to get its quota."""
    probe = CpuLimit("probe", [], 1.0)
    probe.close()
    if probe.mechanism == "duty cycle":
        pytest.skip("no cgroup can be made here (not root or a read-only cgroup file system)")
    child = (
        "from torchtitan_ft.testing.cpulimit import CpuLimit\n"
        "import sys, time\n"
        "sys.stdin.readline()\n"  # the parent has moved this process into its limit
        "limit = CpuLimit('inner', [], 0.5)\n"
        "print(limit.parent, limit.weight, limit._dir, sep='|', flush=True)\n"
        "limit.close()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    with CpuLimit("outer", [proc.pid], 1.5) as outer:
        out, _ = proc.communicate("go\n", timeout=60)
        parent, weight, folder = out.strip().split("|")
        assert outer._dir is not None and outer._dir.name == Path(parent).name
        assert Path(folder).parent == outer._dir
        assert weight in (f"cpu.shares {V1_SHARES}", f"cpu.weight {V2_WEIGHT}")
    assert proc.returncode == 0
