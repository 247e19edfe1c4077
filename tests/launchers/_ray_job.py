"""``python -m tests.launchers._ray_job --out DIR``: a Ray Train job on Ray's own torchft backend
(``ray.train.v2.torch.torchft_config.TorchftConfig``, Ray >= 2.60), training a tiny linear model
through the torchft compatibility package (``compat/``: ``torchft.Manager``, ... are
torchtitan_ft's), on a one-node Ray cluster bound to 127.0.0.1 (``LocalRay``). One replica
group's worker process is SIGKILLed once it committed ``--kill_at_step``; Ray replaces that
group alone, the others train on. Prints one JSON object: each group's record
(``group<G>.jsonl``: one ``start`` per process, one ``step`` per committed step, ``end`` with a
hash of its parameters) and the kill.

Needs ``ray[train]`` (scripts/install_ray.sh) and the compatibility package and this checkout
on ``PYTHONPATH``, so that Ray's workers import both (tests/launchers/test_ray.py).

Each Ray worker is one replica group of one rank (Ray's backend makes ``replica_group_size=1``);
its world rank is the group's index. A group stops once it committed ``--steps`` steps in a
quorum of all ``--groups`` groups, so that a group that trained alone while another was away
goes on until the replacement is back, and all stop at the same step.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import ray
import ray.train
import torch
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from ray.train.v2.torch.torchft_config import TorchftConfig
from torch import nn
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
from torchft.checkpointing.http_transport import HTTPTransport

from torchtitan_ft.testing.processes import descendants, free_port

HOST = "127.0.0.1"
STEP_SLEEP_S = 0.1
"""Pause after each step, so that a group does not run far ahead while the other is replaced."""
START_ATTEMPTS = 3
PR_SET_PDEATHSIG = 1
"""prctl(2): the signal a process gets when its parent ends."""


def _record(out: Path, group: int, **fields: Any) -> None:
    with open(out / f"group{group}.jsonl", "a") as f:
        f.write(json.dumps({**fields, "time": time.time()}) + "\n")


def params_hash(model: nn.Module) -> str:
    """sha256 of the parameters' bytes, in ``named_parameters`` order."""
    digest = hashlib.sha256()
    for _, p in model.named_parameters():
        digest.update(p.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()


def train_loop(config: dict[str, Any]) -> None:
    """One replica group (a Ray Train worker): trains until it committed ``steps`` steps in a
    quorum of all ``groups`` groups (at most ``max_steps``), recording each committed step."""
    group = ray.train.get_context().get_world_rank()
    out, groups = Path(config["out"]), config["groups"]
    _record(out, group, event="start", pid=os.getpid())
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    timeout = timedelta(seconds=30)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        world_size=1,
        rank=0,
        replica_id=f"ray_group_{group}",
        hostname=HOST,
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
        checkpoint_transport=HTTPTransport(timeout=timeout, num_chunks=0, hostname=HOST),
    )
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)
    while True:
        step = manager.current_step()
        data = torch.Generator().manual_seed(1000 * step + group)
        x = torch.randn(8, 4, generator=data)
        optimizer.zero_grad()
        ddp(x).square().mean().backward()
        optimizer.step()
        committed = manager.current_step()  # past step + 1 after a heal
        if committed > step:
            participants = manager.num_participants()
            _record(out, group, event="step", step=committed, participants=participants)
            done = committed >= config["steps"] and participants == groups
            if done or committed >= config["max_steps"]:
                break
        time.sleep(STEP_SLEEP_S)
    _record(out, group, event="end", step=manager.current_step(), params=params_hash(model))
    manager.shutdown()


def read_records(out: Path, group: int) -> list[dict[str, Any]]:
    """Group ``group``'s records so far (a line being written is left out)."""
    path = out / f"group{group}.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def kill_when(out: Path, group: int, at_step: int, groups: int, killed: dict[str, Any]) -> None:
    """SIGKILLs group ``group``'s worker process once it committed ``at_step`` in a quorum of
    all ``groups`` groups (so that another group holds the job's state: killing its only
    holder would rightly end the job with the state lost); fills ``killed`` with its pid and
    the time."""
    while True:
        records = read_records(out, group)
        steps = [r["step"] for r in records if r["event"] == "step" and r["participants"] == groups]
        if steps and steps[-1] >= at_step:
            pid = [r["pid"] for r in records if r["event"] == "start"][-1]
            os.kill(pid, signal.SIGKILL)
            killed.update(pid=pid, time=time.time(), step=steps[-1])
            return
        time.sleep(0.05)


class LocalRay:
    """A one-node Ray cluster on 127.0.0.1, ``ray start --head --block`` as a child process
    (no dashboard, no usage stats), and this process connected to it.

    Ray 2.60's raylet waits a fixed 15 s for its dashboard agent to write the agent's HTTP port
    to a file (``NodeManager::WaitForDashboardAgentPorts``; the port given to ``ray start`` is
    passed to the agent but not to the raylet), and aborts after: an agent still importing on
    a loaded 2-core machine misses it, and the node never registers. Such a start is stopped
    and tried again, up to ``START_ATTEMPTS`` times; ``failed_starts`` counts them. The other
    agent ports are given, so that the raylet waits for no other file.
    """

    def __init__(self, cpus: int, temp_dir: Path) -> None:
        self.failed_starts: list[str] = []
        """The output's tail of each failed ``ray start``."""
        for _ in range(START_ATTEMPTS):
            self.address = f"{HOST}:{free_port()}"
            self.proc, output = self._start(cpus, temp_dir)
            if self.proc is not None:
                break
            self.failed_starts.append(output[-1500:])
        else:
            raise RuntimeError(f"ray start failed {START_ATTEMPTS} times: {self.failed_starts}")
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()  # drains the pipe
        ray.init(address=self.address, log_to_driver=False)

    def _start(self, cpus: int, temp_dir: Path) -> tuple[subprocess.Popen[str] | None, str]:
        """``ray start`` until it says the node is up, and its output so far; None (and it is
        stopped) when it ends or says it timed out first."""
        flags = {
            "node-ip-address": HOST,
            "port": self.address.rsplit(":", 1)[1],
            "num-cpus": cpus,
            "include-dashboard": "false",
            "dashboard-agent-grpc-port": free_port(),
            "dashboard-agent-listen-port": free_port(),
            "metrics-export-port": free_port(),
            "runtime-env-agent-port": free_port(),
            "include-log-monitor": "false",  # fewer processes starting beside the agent
            "temp-dir": temp_dir,
        }
        ray_cli = Path(sys.executable).parent / "ray"
        proc = subprocess.Popen(
            [str(ray_cli), "start", "--head", "--block", "--disable-usage-stats", "--no-monitor"]
            + [f"--{k}={v}" for k, v in flags.items()],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=_end_with_parent,
        )
        output = []
        for line in proc.stdout:
            output.append(line)
            if "Ray runtime started" in line:
                return proc, "".join(output)
            if "timed out during startup" in line:
                break
        _stop(proc)
        return None, "".join(output)

    def stop(self) -> None:
        """Disconnects and stops the cluster."""
        ray.shutdown()
        _stop(self.proc)


def _end_with_parent() -> None:
    """In the ``ray start`` child before it runs: SIGTERM when this process ends, however it
    ends (``ray start --block`` then stops its processes, and its reaper those it missed)."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def _stop(proc: subprocess.Popen[str]) -> None:
    """SIGTERM to ``ray start`` (which ends the processes it started), then SIGKILL to any of
    them still there after 30 s."""
    processes = descendants(proc.pid)
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(_alive(p) for p in processes):
        time.sleep(0.2)
    for pid in processes:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def main() -> None:
    args = _parser().parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(f"{__name__}: SIGTERM"))  # runs finally
    # Ray's unix sockets live under its temp dir, whose path must stay short (107 bytes in all).
    ray_dir = Path(tempfile.mkdtemp(prefix="ftray-"))
    try:
        result = run_job(args, out, ray_dir)
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
    print(json.dumps(result), flush=True)
    # Seen here: after ray.shutdown() the driver stayed alive for minutes after main returned
    # (threads of Ray's client left running), which would hold the test until its timeout.
    os._exit(0)


def run_job(args: argparse.Namespace, out: Path, ray_dir: Path) -> dict[str, Any]:
    """Starts the cluster, trains with the kill, stops the cluster; the result to print."""
    started = time.time()
    cluster = LocalRay(args.groups + 1, ray_dir)
    ray_up = time.time()
    killed: dict[str, Any] = {}
    killer = threading.Thread(
        target=kill_when,
        args=(out, args.kill_group, args.kill_at_step, args.groups, killed),
        daemon=True,
    )
    killer.start()
    trainer = TorchTrainer(
        train_loop_per_worker=train_loop,
        train_loop_config={
            "out": str(out),
            "groups": args.groups,
            "steps": args.steps,
            "max_steps": 20 * args.steps,
        },
        scaling_config=ScalingConfig(num_workers=args.groups, use_gpu=False),
        torch_config=TorchftConfig(
            lighthouse_kwargs={"bind": f"{HOST}:0", "min_replicas": 1}, backend="gloo"
        ),
        run_config=RunConfig(
            storage_path=str(out / "storage"), failure_config=FailureConfig(max_failures=2)
        ),
    )
    error = None
    try:
        trainer.fit()
    except Exception as e:  # the test reports it with the groups' records
        error = f"{type(e).__name__}: {e}"
    finally:
        cluster.stop()
    return {
        "ray_version": ray.__version__,
        "ray_start_s": round(ray_up - started, 1),
        "ray_failed_starts": len(cluster.failed_starts),
        "error": error,
        "killed": killed,
        "groups": {g: read_records(out, g) for g in range(args.groups)},
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for the records and Ray's storage")
    parser.add_argument("--groups", type=int, default=2, help="replica groups (Ray workers)")
    parser.add_argument("--steps", type=int, default=30, help="committed steps to train")
    parser.add_argument("--kill_group", type=int, default=1, help="the group SIGKILLed")
    parser.add_argument(
        "--kill_at_step", type=int, default=8, help="kill it once it committed this step"
    )
    return parser


if __name__ == "__main__":
    main()
