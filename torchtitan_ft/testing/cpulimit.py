"""A CPU limit on a set of processes, to slow a replica group down for real (the straggler
tests and ``benchmarks.stragglers``).

The kernel enforces it: a cgroup with a CFS quota (cgroup v2 ``cpu.max``, or v1
``cpu.cfs_quota_us`` where the machine has v1, as this project's test machine does). Where
neither can be created (no root, read-only cgroup file system) it falls back to a SIGSTOP /
SIGCONT duty cycle driven by a thread of the calling process, which is coarser (its period is
a scheduler's tick or more on a busy machine). ``CpuLimit.mechanism`` says which one is used.

A quota is a ceiling, not a budget: on a shared machine the other processes still take a
limited group's CPU. So the cgroup is also given the highest CPU weight (v1 ``cpu.shares``
262144, v2 ``cpu.weight`` 10000, against 1024 / 100 for everything else), which makes the quota
what the group gets as long as the quotas of all such groups add up to less than the CPU their
parent has. And it is made under the caller's own cgroup (``/proc/self/cgroup``), not at the
root, so that it shares what the caller was given (e.g. a run under a prioritised, capped
cgroup) rather than escaping it. Leave CPU for the processes outside the limits (the caller,
a lighthouse): with the weight, limited groups that add up to all of the parent's CPU starve
them. ``CpuLimit.parent`` and ``CpuLimit.weight`` say what was set.

    with CpuLimit("group_3", [proc.pid], cpus=0.25) as limit:
        ...
        limit.set(cpus=0.0625)  # 4x slower
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import uuid
from collections.abc import Iterable
from pathlib import Path

PERIOD_US = 10_000
"""The CFS period: quotas are shares of 10 ms. Shorter than a step's compute, so that every
step is throttled alike (with 100 ms, a short compute often fits in one period's quota and the
next one pays for it all). The kernel's smallest quota is 1 ms: ``cpus`` >= 0.1."""
_V2_ROOT = Path("/sys/fs/cgroup")
_V1_ROOT = Path("/sys/fs/cgroup/cpu")
V1_SHARES = 262_144
"""cgroup v1 ``cpu.shares`` of a limit: the kernel's maximum (a process's default is 1024)."""
V2_WEIGHT = 10_000
"""cgroup v2 ``cpu.weight`` of a limit: the kernel's maximum (the default is 100)."""


def own_cgroup(proc_self_cgroup: str, v2: bool) -> str:
    """The caller's cgroup path for the CPU controller ("/" for the root), from the text of
    ``/proc/self/cgroup``: the ``0::PATH`` line on cgroup v2, on v1 the line whose controller
    list holds ``cpu`` (``4:cpu,cpuacct:/PATH``). Pure."""
    for line in proc_self_cgroup.splitlines():
        number, controllers, path = line.split(":", 2)
        if (v2 and number == "0" and controllers == "") or (
            not v2 and "cpu" in controllers.split(",")
        ):
            return path or "/"
    return "/"


class CpuLimit:
    """At most ``cpus`` CPUs (e.g. 0.25: a quarter of one core) for the processes ``pids``.

    Args:
        name: part of the cgroup's name (a random suffix keeps runs apart).
        pids: the processes to limit (their threads go with them).
        cpus: the limit, > 0.
        duty_cycle: use the SIGSTOP/SIGCONT duty cycle even where a cgroup could be made. A
            quota only caps the processes, and on a machine loaded beyond its cores every
            process may already get less than the cap; the duty cycle stops them for
            ``1 - cpus`` of the wall time, so they run ``cpus`` times as fast as their peers
            whatever the load.
        duty_period_s: the duty cycle's period. On a loaded machine the thread that drives
            it wakes late, which lengthens both its running and its stopped window; a longer
            period keeps the share closer to ``cpus``.
    """

    def __init__(
        self,
        name: str,
        pids: Iterable[int],
        cpus: float,
        *,
        duty_cycle: bool = False,
        duty_period_s: float = 0.04,
    ) -> None:
        self._pids = list(pids)
        self._dir: Path | None = None
        self._duty: _DutyCycle | None = None
        self.mechanism = "none"
        """``"cgroup v2 cpu.max"``, ``"cgroup v1 cpu.cfs_quota_us"`` or ``"duty cycle"``."""
        self.parent: str | None = None
        """The cgroup the limit's cgroup was made under (the caller's own; "/" for the root)."""
        self.weight: str | None = None
        """The CPU weight set on it, e.g. ``"cpu.shares 262144"`` (None: a duty cycle)."""
        cgroup = f"torchtitan_ft_{name}_{uuid.uuid4().hex[:8]}"
        if duty_cycle:
            if not cpus > 0:
                raise ValueError(f"cpus must be > 0, got {cpus!r}")
            self.mechanism = "duty cycle"
            self._duty = _DutyCycle(self._pids, cpus, duty_period_s)
            return
        try:
            v2 = (_V2_ROOT / "cgroup.controllers").exists()
            self.parent = own_cgroup(Path("/proc/self/cgroup").read_text(), v2)
            root = _V2_ROOT if v2 else _V1_ROOT
            self._dir = self._make_under(root, self.parent, cgroup, v2)
            self.mechanism = "cgroup v2 cpu.max" if v2 else "cgroup v1 cpu.cfs_quota_us"
            if v2:
                (self._dir / "cpu.weight").write_text(f"{V2_WEIGHT}\n")
                self.weight = f"cpu.weight {V2_WEIGHT}"
            else:
                (self._dir / "cpu.shares").write_text(f"{V1_SHARES}\n")
                self.weight = f"cpu.shares {V1_SHARES}"
            self.set(cpus)
            procs = self._dir / "cgroup.procs"
            for pid in self._pids:
                procs.write_text(f"{pid}\n")
        except OSError:
            self._remove_cgroup()
            self._dir, self.mechanism, self.weight = None, "duty cycle", None
            self._duty = _DutyCycle(self._pids, cpus, duty_period_s)

    def _make_under(self, root: Path, parent: str, name: str, v2: bool) -> Path:
        """Makes cgroup ``name`` under ``parent``; under the root where the parent's folder is
        not there or (v2) cannot hand the cpu controller down, which a cgroup holding processes
        itself cannot: :attr:`parent` says where."""
        under = root / parent.lstrip("/")
        if not under.is_dir():  # a cgroup namespace's view, or a mount of another shape
            under, self.parent = root, "/"
        elif v2 and parent != "/":
            try:
                (under / "cgroup.subtree_control").write_text("+cpu\n")
            except OSError:
                under, self.parent = root, "/"
        path = under / name
        path.mkdir()
        return path

    def add(self, pid: int) -> None:
        """Puts process ``pid`` under the limit too (the children it starts afterwards follow)."""
        if self._duty is not None:
            self._duty.pids.append(pid)
        elif self._dir is not None:
            (self._dir / "cgroup.procs").write_text(f"{pid}\n")

    def set(self, cpus: float) -> None:
        """Changes the limit to ``cpus`` CPUs (> 0)."""
        if not cpus > 0:
            raise ValueError(f"cpus must be > 0, got {cpus!r}")
        if self._duty is not None:
            self._duty.cpus = cpus
        elif self._dir is not None:
            quota = max(int(cpus * PERIOD_US), 1000)  # the kernel's minimum
            if self.mechanism.startswith("cgroup v2"):
                (self._dir / "cpu.max").write_text(f"{quota} {PERIOD_US}\n")
            else:
                (self._dir / "cpu.cfs_period_us").write_text(f"{PERIOD_US}\n")
                (self._dir / "cpu.cfs_quota_us").write_text(f"{quota}\n")

    def close(self) -> None:
        """Lifts the limit (the processes go back to the parent cgroup, or keep running)."""
        if self._duty is not None:
            self._duty.stop()
        self._remove_cgroup()

    def _remove_cgroup(self) -> None:
        if self._dir is None or not self._dir.exists():
            return
        parent = self._dir.parent / "cgroup.procs"
        with contextlib.suppress(OSError):
            for pid in (self._dir / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):  # it may have exited meanwhile
                    parent.write_text(f"{pid}\n")
        with contextlib.suppress(OSError):
            self._dir.rmdir()

    def __enter__(self) -> CpuLimit:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class _DutyCycle:
    """Stops and continues ``pids`` so that they run ``cpus`` of each ``period_s`` (``cpus``
    >= 1: never stopped)."""

    def __init__(self, pids: list[int], cpus: float, period_s: float) -> None:
        if not period_s > 0:
            raise ValueError(f"duty_period_s must be > 0, got {period_s!r}")
        self.pids = pids
        self.cpus = cpus
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu_duty_cycle", daemon=True)
        self._thread.start()

    def _signal(self, sig: int) -> None:
        for pid in list(self.pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def _run(self) -> None:
        while not self._stop.is_set():
            share = min(self.cpus, 1.0)
            if share >= 1.0:
                self._stop.wait(self.period_s)
                continue
            self._stop.wait(self.period_s * share)
            self._signal(signal.SIGSTOP)
            self._stop.wait(self.period_s * (1 - share))
            self._signal(signal.SIGCONT)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._signal(signal.SIGCONT)
