"""The parts of ``scripts/gpu_check.py`` that run the FT stack on the device (``manager``,
``nccl``, ``semi_sync``, ``titan``; :mod:`torchtitan_ft.testing.gpu_check` describes each and
runs them): imported only by a part's own process, so it imports torch and the stack at once."""

from __future__ import annotations

import os
import shutil
import statistics
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from torchtitan_ft import DiLoCo, Manager, OptimizerWrapper, ProcessGroupGloo
from torchtitan_ft.lighthouse import LighthouseServer
from torchtitan_ft.process_group import (
    NativeProcessGroup,
    ProcessGroupBabyGloo,
    ProcessGroupBabyNCCL,
    ProcessGroupNCCL,
)
from torchtitan_ft.process_group.base import native_reconfigure_available
from torchtitan_ft.testing import titan_jobs as _jobs
from torchtitan_ft.testing.gpu_check import PARTS, Checks, Device
from torchtitan_ft.testing.titan_dump import dump_path, ready_path
from torchtitan_ft.testing.titan_jobs import step_durations


def _torch_device(device: Device) -> Any:
    return torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else "cpu"


# ---------------------------------------------------------------------- two Managers


def _manager(replica: int, lighthouse: str, pg: Any, load: Callable, state: Callable) -> Any:
    """Replica group ``replica``'s Manager (1 rank; the two groups form quorums together)."""
    return Manager(
        pg=pg,
        load_state_dict=load,
        state_dict=state,
        min_replica_size=2,
        use_async_quorum=False,
        replica_id=f"gpu_check_{replica}",
        hostname="127.0.0.1",
        lighthouse_addr=lighthouse,
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=0,
        timeout=timedelta(seconds=30),
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=30),
    )


def _in_threads(target: Callable[[int], Any], count: int = 2, timeout_s: float = 120) -> list:
    """``target(i)`` for each i in its own thread (a replica group each); their results, or the
    first exception raised."""
    results: list[Any] = [None] * count
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = target(i)
        except BaseException as e:  # handed to the caller
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"a replica group's thread still runs after {timeout_s} s")
    return results


def manager(device: Device, out: Path, checks: Checks, figures: dict) -> str | None:
    dev = _torch_device(device)
    size = 1 << 20

    class RecordingGloo(ProcessGroupGloo):
        """Records the CUDA device current in the thread that configures it (the quorum's)."""

        configured_on: list[Any] = []

        def _configure(self, config: Any) -> None:
            current = torch.cuda.current_device() if device == "cuda" else "cpu"
            self.configured_on.append((threading.current_thread().name, current))
            super()._configure(config)

    def group(replica: int) -> dict[str, Any]:
        if device == "cuda":
            torch.cuda.set_device(dev)
        param = torch.nn.Parameter(torch.full((size,), float(replica + 1), device=dev))
        pg = RecordingGloo(timeout=timedelta(seconds=30))
        mgr = _manager(
            replica,
            lighthouse.address(),
            pg,
            lambda state: param.data.copy_(state["p"]),
            lambda: {"p": param.detach()},
        )
        optimizer = OptimizerWrapper(mgr, torch.optim.SGD([param], lr=0.5))
        try:
            # Step 1: the gradient is made by queued device work, then averaged across groups.
            optimizer.zero_grad()
            grad = torch.full((size,), float(replica + 1), device=dev)
            for _ in range(20):  # work still queued on the stream when allreduce is called
                grad = grad * 1.0001
            grad /= 1.0001**20
            param.grad = grad
            mgr.allreduce(param.grad)
            committed = mgr.should_commit()
            # Read the result on another stream, without waiting for the current one: only
            # correct if should_commit waited for the all-reduce's device work.
            if device == "cuda":
                side = torch.cuda.Stream(device=dev)
                with torch.cuda.stream(side):
                    seen = param.grad.to("cpu", non_blocking=False)
            else:
                seen = param.grad.clone()
            averaged = bool(torch.allclose(seen, torch.full_like(seen, 1.5), rtol=1e-4))
            optimizer.step()
            step_after_commit = mgr.current_step()
            after_commit = param.detach().clone()
            # Step 2: an error recorded in the step: it is discarded, parameters untouched.
            optimizer.zero_grad()
            param.grad = torch.ones_like(param)
            mgr.allreduce(param.grad)
            mgr.report_error(RuntimeError("gpu_check: injected error"))
            discarded = not optimizer.step()
            untouched = bool(torch.equal(param.detach(), after_commit))
            return {
                "committed": committed,
                "averaged": averaged,
                "discarded": discarded,
                "untouched": untouched,
                "step_after_commit": step_after_commit,
                "step_after_discard": mgr.current_step(),
                "param_device": str(param.device),
            }
        finally:
            mgr.shutdown(wait=False)

    main_device = torch.cuda.current_device() if device == "cuda" else "cpu"
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=2000)
    started = time.monotonic()
    try:
        results = _in_threads(group)
    finally:
        lighthouse.shutdown()
    figures["groups"] = results
    figures["wall_two_steps_s"] = round(time.monotonic() - started, 2)
    figures["configured_on"] = RecordingGloo.configured_on
    devices = {d for _, d in RecordingGloo.configured_on}
    checks.expect(
        "quorum thread on the caller's device",
        bool(devices) and devices == {main_device},
        f"configured on {RecordingGloo.configured_on}, the caller's device is {main_device}",
    )
    for r, g in enumerate(results):
        checks.expect(f"group {r} committed the first step", g["committed"], str(g))
        checks.expect(f"group {r} all-reduce averaged (read on another stream)", g["averaged"])
        discarded = g["discarded"] and g["step_after_discard"] == g["step_after_commit"]
        checks.expect(f"group {r} discarded the step with an error", discarded, str(g))
        checks.expect(f"group {r} parameters untouched by the discarded step", g["untouched"])
    return None


# ---------------------------------------------------------------------- process groups


def pg_cycle(make_pg: Callable[[], Any], dev: Any, store_port: int, tag: str, into: dict) -> None:
    """One rank: configure, all-reduce, abort, configure again, all-reduce; then an all-reduce
    stuck on a peer (rank 1 of 2, which configures and never joins the collective) fails past
    the timeout, and the group configures again with one rank. Records its figures in
    ``into`` as it goes (an exception keeps those measured before it)."""
    pg = make_pg()
    addr = f"127.0.0.1:{store_port}"
    started = time.monotonic()
    pg.configure(f"{addr}/{tag}-q0", "gpu_check_0", 0, 1)
    into["configure_s"] = round(time.monotonic() - started, 2)
    t = torch.full((4,), 2.0, device=dev)
    pg.allreduce([t]).wait()
    into["allreduce_ok"] = bool(torch.equal(t.cpu(), torch.full((4,), 2.0)))
    pg.abort()
    pg.configure(f"{addr}/{tag}-q1", "gpu_check_0", 0, 1)
    t = torch.full((4,), 3.0, device=dev)
    pg.allreduce([t]).wait()
    into["reconfigured_allreduce_ok"] = bool(torch.equal(t.cpu(), torch.full((4,), 3.0)))

    peer = make_pg()
    joined = threading.Thread(
        target=peer.configure, args=(f"{addr}/{tag}-q2", "gpu_check_1", 1, 2), daemon=True
    )
    joined.start()
    pg.configure(f"{addr}/{tag}-q2", "gpu_check_0", 0, 2)
    joined.join(60)
    work = pg.allreduce([torch.ones(4, device=dev)])
    failed, error, waited = _wait_bounded(work, PG_TIMEOUT_S * 3 + 10)
    into.update(stuck_allreduce_failed=failed, stuck_allreduce_s=waited)
    into["stuck_allreduce_error"] = error
    pg.abort()
    peer.abort()
    pg.configure(f"{addr}/{tag}-q3", "gpu_check_0", 0, 1)
    t = torch.full((4,), 5.0, device=dev)
    pg.allreduce([t]).wait()
    into["after_stuck_allreduce_ok"] = bool(torch.equal(t.cpu(), torch.full((4,), 5.0)))
    pg.shutdown()
    peer.shutdown()


def _wait_bounded(work: Any, limit_s: float) -> tuple[bool, str | None, float]:
    """Waits for ``work`` in a thread, at most ``limit_s``: whether it failed, its error (or
    why it counts as failed: it never returned) and the seconds waited."""
    outcome: dict[str, Any] = {}

    def wait() -> None:
        try:
            work.wait()
        except Exception as e:  # what a stuck collective should end with
            outcome["error"] = f"{type(e).__name__}: {e}"[:300]
        outcome["returned"] = True

    started = time.monotonic()
    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(limit_s)
    waited = round(time.monotonic() - started, 2)
    if "returned" not in outcome:
        return False, f"wait() still blocked after {limit_s:.0f} s", waited
    return "error" in outcome, outcome.get("error"), waited


PG_TIMEOUT_S = 5.0
"""The timeout of the groups of the ``nccl`` part: the stuck all-reduce fails after it."""


def _check_cycle(checks: Checks, name: str, figures: dict[str, Any]) -> None:
    for key in ("allreduce_ok", "reconfigured_allreduce_ok", "after_stuck_allreduce_ok"):
        checks.expect(f"{name}: {key}", figures.get(key, False))
    waited = figures.get("stuck_allreduce_s", 0.0)
    checks.expect(
        f"{name}: stuck all-reduce failed at its timeout",
        figures.get("stuck_allreduce_failed", False) and waited >= PG_TIMEOUT_S * 0.9,
        f"{figures.get('stuck_allreduce_error')} after {figures.get('stuck_allreduce_s')} s "
        f"(timeout {PG_TIMEOUT_S} s)",
    )


def nccl(device: Device, out: Path, checks: Checks, figures: dict) -> str | None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=PG_TIMEOUT_S)
    if device == "cuda":
        groups = {
            "ProcessGroupNCCL": ProcessGroupNCCL,
            "ProcessGroupBabyNCCL": ProcessGroupBabyNCCL,
        }
        key, dev = "groups", _torch_device(device)
    else:  # the same sequence on gloo, so that the part itself is tested without a GPU
        groups = {
            "ProcessGroupGloo": ProcessGroupGloo,
            "ProcessGroupBabyGloo": ProcessGroupBabyGloo,
        }
        key, dev = "gloo_rehearsal", "cpu"
    figures[key] = {}
    for name, cls in groups.items():
        cycle = figures[key][name] = {}
        try:
            pg_cycle(lambda cls=cls: cls(timeout=timeout), dev, store.port, name, cycle)
        except Exception as e:  # the next group still runs; the report says where it broke
            cycle["error"] = traceback.format_exc()
            checks.expect(f"{name}: the sequence ran", False, f"{type(e).__name__}: {e}"[:300])
        _check_cycle(checks, name, cycle)
    return None if device == "cuda" else "needs CUDA (NCCL); the gloo rehearsal of it ran"


# ---------------------------------------------------------------------- native nccl2

NATIVE_CYCLES = 3
"""Reconfigures of the ``native_nccl2`` part, each followed by an all-reduce and an abort."""


def native_nccl2(device: Device, out: Path, checks: Checks, figures: dict) -> str | None:
    """torch's native reconfigurable group over ``nccl2`` (``init_process_group(...,
    enable_reconfigure=True)``) as the Manager drives it, one rank (one GPU): reconfigure with a
    fresh uuid, all-reduce a device tensor, abort, NATIVE_CYCLES times; each reconfigure's
    time is a figure."""
    if not native_reconfigure_available():
        return f"torch {torch.__version__} has no native reconfigure (needs torch>=2.14)"
    if device != "cuda":
        return (
            "needs CUDA (nccl2); the native gloo group runs on CPU in "
            "tests/process_group/test_native.py"
        )
    dev = _torch_device(device)
    torch.cuda.set_device(dev)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=PG_TIMEOUT_S)
    dist.init_process_group(
        "nccl2",
        store=dist.PrefixStore("native", store),
        rank=0,
        world_size=1,
        timeout=timeout,
        enable_reconfigure=True,
    )
    try:
        pg = NativeProcessGroup(dist.group.WORLD, timeout)
        figures["backend"] = pg.getBackendName()
        figures["reconfigure_s"] = []
        for cycle in range(NATIVE_CYCLES):
            started = time.monotonic()
            pg.configure(f"127.0.0.1:{store.port}/native-q{cycle}", "gpu_check_0", 0, 1)
            figures["reconfigure_s"].append(round(time.monotonic() - started, 3))
            t = torch.full((4,), float(cycle + 2), device=dev)
            pg.allreduce([t]).wait()
            torch.cuda.synchronize(dev)
            ok = torch.equal(t.cpu(), torch.full((4,), float(cycle + 2)))
            checks.expect(f"nccl2: all-reduce after reconfigure {cycle}", ok, f"got {t.cpu()}")
            pg.abort()  # the next reconfigure must bring it back
    finally:
        dist.destroy_process_group()
    return None


# ---------------------------------------------------------------------- semi-sync

OUTER_STEPS = 3
"""Syncs of the ``semi_sync`` part (each group takes ``OUTER_STEPS * SYNC_EVERY`` inner steps)."""
SYNC_EVERY = 2


def semi_sync(device: Device, out: Path, checks: Checks, figures: dict) -> str | None:
    dev = _torch_device(device)

    def group(replica: int) -> dict[str, Any]:
        if device == "cuda":
            torch.cuda.set_device(dev)
        torch.manual_seed(replica)  # different inits: the first quorum makes them equal
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)
        ).to(dev)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)

        def state_dict() -> dict[str, Any]:
            return {"model": model.state_dict(), "optim": inner.state_dict()}

        def load_state_dict(state: dict[str, Any]) -> None:
            model.load_state_dict(state["model"])
            inner.load_state_dict(state["optim"])

        pg = ProcessGroupGloo(timeout=timedelta(seconds=30))
        mgr = _manager(replica, lighthouse.address(), pg, load_state_dict, state_dict)
        data = torch.Generator().manual_seed(1000 + replica)
        try:
            with DiLoCo(
                mgr, [model], inner, outer, sync_every=SYNC_EVERY, should_quantize=True
            ) as diloco:
                for _ in range(OUTER_STEPS * SYNC_EVERY):
                    x = torch.randn(32, 64, generator=data).to(dev)
                    inner.zero_grad()
                    loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
                    loss.backward()
                    inner.step()
            params = [p.detach().cpu() for p in model.parameters()]
            return {
                "syncs_committed": mgr.current_step(),
                "syncs_failed": diloco.stats.syncs_failed,
                "loss": loss.item(),
                "params": params,
            }
        finally:
            mgr.shutdown(wait=False)

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=2000)
    started = time.monotonic()
    try:
        results = _in_threads(group)
    finally:
        lighthouse.shutdown()
    figures["wall_s"] = round(time.monotonic() - started, 2)
    params = [g.pop("params") for g in results]
    for r, g in enumerate(results):
        figures[f"group{r}"] = {**g, "param_device": str(dev)}
        committed = g["syncs_failed"] == 0 and g["syncs_committed"] >= OUTER_STEPS
        checks.expect(f"group {r}: every sync committed", committed, str(g))
    identical = all(torch.equal(a, b) for a, b in zip(*params, strict=True))
    checks.expect("models bitwise identical after the last sync", identical)
    return None


# ---------------------------------------------------------------------- TorchTitan

TITAN_STEPS = {"cuda": 30, "cpu": 16}
TITAN_KILL_AT = {"cuda": 12, "cpu": 6}
TITAN_DTYPE = {"cuda": "bfloat16", "cpu": "float32"}
TITAN_WARMUP = 3
"""Steps left out of the no-FT step-time medians (the first steps' set-up)."""
TITAN_STEPS_BEFORE_KILL = 4
"""Steps both groups train together before group 1 is killed, at least (their step times are
the FT figure)."""


def _median_step_s(run: Any, first: int, last: int) -> float | None:
    durations = step_durations(run, first, last)
    return round(statistics.median(durations), 4) if durations else None


def titan(device: Device, out: Path, checks: Checks, figures: dict) -> str | None:
    """Needs the checkout (``run_train.sh``, ``configs/``)."""
    steps, kill_at = TITAN_STEPS[device], TITAN_KILL_AT[device]
    dtype = (f"--training.mixed_precision_param={TITAN_DTYPE[device]}",)
    figures.update(steps=steps, kill_at_step=kill_at, param_dtype=TITAN_DTYPE[device])
    figures["load_avg_1m_at_start"] = os.getloadavg()[0]  # CPU figures depend on it
    _jobs.set_budget(PARTS["titan"].limit_s[device] - 10)
    work = out / "titan"
    try:
        # First without FT: the same two processes at the same time on the same device.
        plain = [
            _jobs.TrainRun(f"no-FT {r}", steps, work / f"plain{r}", *dtype, env={
                "CONFIG_FILE": str(_jobs.CONFIGS / "debug_cpu.toml")})
            for r in range(2)
        ]  # fmt: skip
        _jobs.finish_all(plain)
        no_ft = [_median_step_s(run, TITAN_WARMUP, steps) for run in plain]
        figures["no_ft_median_step_s"] = no_ft

        def group(replica: int, address: str) -> Any:
            return _jobs.TrainRun(
                f"replica group {replica}",
                steps,
                work / f"ft{replica}",
                f"--fault_tolerance.replica_id={replica}",
                "--fault_tolerance.process_group=gloo",  # 2 processes, 1 GPU: no NCCL across
                *dtype,
                env=_jobs.ft_env(
                    "debug_ft_cpu.toml",
                    address,
                    TRAIN_FILE="torchtitan_ft.testing.titan_dump",
                    FT_E2E_OUT=str(work),
                    FT_E2E_ALONE_SLEEP_S="0.2" if device == "cuda" else "0.5",
                    FT_E2E_MAX_ALONE="4",
                ),
            )

        work.mkdir(parents=True, exist_ok=True)
        lighthouse = _jobs.lighthouse(
            min_replicas=1, join_timeout_ms=20000, heartbeat_timeout_ms=2000
        )
        with lighthouse as address:
            survivor, killed = group(0, address), group(1, address)
            # Group 0 may train a few steps alone before group 1 is up and heals into a later
            # step: the FT step times start 2 steps past group 1's first, both groups in.
            killed.wait_for(r"step:\s*\d+\s+loss")
            first = killed.step_lines()[0][0] + 2
            kill_at = max(kill_at, first + TITAN_STEPS_BEFORE_KILL)
            figures.update(together_from_step=first, kill_at_step=kill_at)
            killed.wait_for(rf"step:\s*{kill_at}\s+loss")
            ft = [_median_step_s(run, first, kill_at) for run in (survivor, killed)]
            killed.sigkill()
            killed.name = "replica group 1 (killed)"
            ready_path(work, 1, 0).unlink(missing_ok=True)
            restarted = group(1, address)
            _jobs.finish_all([survivor, restarted])
        figures["ft_median_step_s"] = ft
        if all(ft) and all(no_ft):
            figures["ft_over_no_ft"] = round(max(ft) / max(no_ft), 3)
        heals = [e["outcome"] for e in restarted.events(_jobs.EventKind.HEAL_END)]
        figures["heal_outcomes"] = heals
        checks.expect("the restarted group healed", "applied" in heals, f"heals ended {heals}")
        states = [torch.load(dump_path(work, r, 0), weights_only=False) for r in range(2)]
        for r in range(2):  # tens of MB each: the report and the logs are what comes back
            dump_path(work, r, 0).unlink()
        figures["final_steps"] = [s["manager"]["step"] for s in states]
        checks.expect("both groups at the last step", figures["final_steps"] == [steps] * 2)
        try:
            _jobs.assert_identical(states[0]["healed"], states[1]["healed"], "state")
            identical, detail = True, ""
        except AssertionError as e:
            identical, detail = False, str(e)
        checks.expect("groups bitwise identical at the end", identical, detail)
    finally:
        for run in _jobs.RUNS:
            (work / "logs").mkdir(parents=True, exist_ok=True)
            (work / "logs" / f"{run.name.replace(' ', '_')}.log").write_text(run.output)
            if run.returncode is None:
                run.sigkill()
        for r in range(2):
            shutil.rmtree(work / f"plain{r}", ignore_errors=True)
            shutil.rmtree(work / f"ft{r}" / "checkpoint", ignore_errors=True)
    return None
