"""Survivor stall when a replica process is SIGKILLed, at the lighthouse level; prints JSON.

Two replicas, both holding heartbeat streams (our client falls back to unary heartbeats
against a lighthouse without streams), form a quorum; then one replica's process is
SIGKILLed and the survivor asks for the next quorum. The stall is the time from the SIGKILL to
the survivor's quorum without the dead replica. Measured for our lighthouse and, in the same
run, torchft 0.2.0's (default 5 s heartbeat timeout for both).

    python -m benchmarks.failure_detection [--trials 3]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from datetime import timedelta

from benchmarks import machine
from benchmarks._reference import load_reference
from torchtitan_ft.lighthouse import LighthouseClient, LighthouseServer

VICTIM = """
import sys, time
from datetime import timedelta
from torchtitan_ft.lighthouse import LighthouseClient
client = LighthouseClient(sys.argv[1])
client.heartbeat_stream("victim", timedelta(milliseconds=100))
time.sleep(0.5)  # heartbeats have reached the lighthouse: the survivor can ask now
print("known", flush=True)
client.quorum("victim", timedelta(seconds=60))
time.sleep(600)
"""


def one_trial(addr: str) -> float:
    survivor = LighthouseClient(addr)
    stream = survivor.heartbeat_stream("survivor", timedelta(milliseconds=100))
    time.sleep(0.5)  # the survivor is known before the victim asks
    victim = subprocess.Popen([sys.executable, "-c", VICTIM, addr], stdout=subprocess.PIPE)
    try:
        victim.stdout.readline()
        first = survivor.quorum("survivor", timedelta(seconds=60))
        if len(first.participants) != 2:
            raise RuntimeError(f"expected a 2-member first quorum, got {first.participants}")
        time.sleep(0.3)  # a few heartbeats in steady state
        killed = time.monotonic()
        victim.send_signal(signal.SIGKILL)
        second = survivor.quorum("survivor", timedelta(seconds=60))
        stall = time.monotonic() - killed
        if [m.replica_id for m in second.participants] != ["survivor"]:
            raise RuntimeError(f"the victim is still in the quorum: {second.participants}")
        return stall
    finally:
        victim.kill()
        victim.wait()
        stream.close()
        survivor.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    args = parser.parse_args()
    reference = load_reference()
    os.environ["RUST_LOG"] = "warn"
    results = {}
    for name in ["torchtitan_ft", "torchft_0.2.0"]:
        if name == "torchft_0.2.0" and reference is None:
            continue
        stalls = []
        for _ in range(args.trials):
            if name == "torchtitan_ft":
                server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
            else:
                server = reference.LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
            try:
                stalls.append(one_trial(server.address()))
            finally:
                server.shutdown()
        results[name] = {
            "stall_ms": [round(s * 1e3, 1) for s in stalls],
            "median_stall_ms": round(statistics.median(stalls) * 1e3, 1),
        }
        print(json.dumps({name: results[name]}), file=sys.stderr)
    ours = results["torchtitan_ft"]["median_stall_ms"]
    out = {
        "benchmark": "failure_detection",
        "machine": machine(),
        "command": " ".join(["python -m benchmarks.failure_detection", *sys.argv[1:]]),
        "setup": "2 replicas on loopback, heartbeat interval 100 ms, heartbeat timeout 5000 ms",
        "target_ms": 200,
        "results": results,
    }
    if "torchft_0.2.0" in results:
        out["speedup_vs_reference"] = round(results["torchft_0.2.0"]["median_stall_ms"] / ours, 1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
