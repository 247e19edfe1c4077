"""A local lighthouse and three replica groups stepping through quorums; one dies, one rejoins.

Each replica group is a process that holds a heartbeat stream to the lighthouse and asks it
for a quorum before every (simulated) training step. Once all three are stepping, one is
SIGKILLed: the survivors' next quorum drops it at once (the lighthouse sees its stream end)
instead of after the 5 s heartbeat timeout. Then a replacement starts and joins them.

    python scripts/lighthouse_demo.py [--steps 10] [--step_ms 100]

Replica groups step until the demo ends; --steps is the length of each phase.
"""

from __future__ import annotations

import argparse
import queue
import signal
import subprocess
import sys
import threading
from datetime import timedelta

from torchtitan_ft.lighthouse import LighthouseClient

REPLICA = """
import itertools, sys, time
from datetime import timedelta
from torchtitan_ft.lighthouse import LighthouseClient
addr, rid, step_s = sys.argv[1], sys.argv[2], float(sys.argv[3])
client = LighthouseClient(addr)
client.heartbeat_stream(rid, timedelta(milliseconds=100))
for step in itertools.count():
    start = time.monotonic()
    q = client.quorum(rid, timedelta(seconds=60), step=step)
    waited_ms = (time.monotonic() - start) * 1000
    members = ",".join(m.replica_id for m in q.participants)
    print(rid, step, q.quorum_id, members, f"{waited_ms:.0f}", flush=True)
    time.sleep(step_s)
"""


class Groups:
    """Replica-group processes whose step lines arrive on one queue."""

    def __init__(self, addr: str, step_s: float) -> None:
        self.addr = addr
        self.step_s = step_s
        self.procs: dict[str, subprocess.Popen] = {}
        self.lines: queue.Queue[list[str]] = queue.Queue()

    def spawn(self, rid: str) -> None:
        proc = subprocess.Popen(
            [sys.executable, "-c", REPLICA, self.addr, rid, str(self.step_s)],
            stdout=subprocess.PIPE,
            text=True,
        )
        self.procs[rid] = proc
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.put(line.split())

    def until(self, done) -> None:
        """Prints step lines until ``done(rid, step, members, waited_ms)`` is true."""
        while True:
            rid, step, quorum_id, members, waited = self.lines.get(timeout=120)
            print(f"  {rid:5s} step {int(step):3d}  quorum ...{int(quorum_id) % 100000:05d} "
                  f"[{members}]  waited {waited} ms", flush=True)  # fmt: skip
            if done(rid, int(step), members.split(","), int(waited)):
                return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="steps in each phase")
    parser.add_argument("--step_ms", type=int, default=100, help="simulated step time")
    parser.add_argument("--port", type=int, default=29510, help="lighthouse gRPC port")
    parser.add_argument("--status_port", type=int, default=29511, help="status page port")
    args = parser.parse_args()

    lighthouse = subprocess.Popen(
        [
            sys.executable, "-m", "torchtitan_ft.lighthouse.cli", "--min_replicas", "2",
            "--bind", f"127.0.0.1:{args.port}",
            "--status_bind", f"127.0.0.1:{args.status_port}",
            "--join_timeout_ms", "10000", "--log_level", "WARNING",
        ]
    )  # fmt: skip
    addr = f"http://127.0.0.1:{args.port}"
    groups = Groups(addr, args.step_ms / 1000)
    try:
        LighthouseClient(addr).heartbeat("demo-probe", timedelta(seconds=30))
        print(f"lighthouse up at {addr}; status page: http://127.0.0.1:{args.status_port}/")
        for rid in ["rg0", "rg1", "rg2"]:
            groups.spawn(rid)
        groups.until(lambda rid, step, members, _: len(members) == 3 and step >= args.steps)

        print(">>> SIGKILL rg1", flush=True)
        groups.procs["rg1"].send_signal(signal.SIGKILL)
        stalls: list[int] = []

        def survivors_moved_on(rid, step, members, waited) -> bool:
            if "rg1" not in members:
                stalls.append(waited)
            return len(stalls) == 2

        groups.until(survivors_moved_on)
        print(f">>> survivors formed a quorum without rg1 after waiting {max(stalls)} ms")

        print(">>> starting replacement rg1b", flush=True)
        groups.spawn("rg1b")
        groups.until(lambda rid, step, members, _: rid == "rg1b" and step == args.steps)
        for rid, proc in groups.procs.items():
            if proc.poll() is not None and rid != "rg1":
                raise SystemExit(f"replica group {rid} died with exit code {proc.returncode}")
        print("done: the survivors kept stepping through the failure; the replacement joined")
    finally:
        for proc in groups.procs.values():
            proc.kill()
        lighthouse.terminate()
        lighthouse.wait(timeout=10)


if __name__ == "__main__":
    main()
