"""Runs an example as a local job: a lighthouse in this process and one process per replica
group, each the same script with ``REPLICA_GROUP_ID`` and ``TORCHFT_LIGHTHOUSE`` set, all on
127.0.0.1. Prints each group's last line (its JSON summary) and exits non-zero if a group
failed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from torchtitan_ft.lighthouse import LighthouseServer


def run_locally(script: str, groups: int) -> None:
    """Starts ``groups`` replica groups of ``script`` beside a local lighthouse and waits.

    The lighthouse issues no quorum until all ``groups`` have asked (``min_replicas``), so the
    groups train together from the first step: a small model trains so fast that a group
    started a moment earlier would otherwise finish alone before the other one has started.
    """
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=groups)
    print(f"lighthouse at {lighthouse.address()}; starting {groups} replica groups", flush=True)
    procs = [
        subprocess.Popen(
            [sys.executable, script],
            env={
                **os.environ,
                "REPLICA_GROUP_ID": str(group),
                "TORCHFT_LIGHTHOUSE": lighthouse.address(),
            },
            stdout=subprocess.PIPE,
            text=True,
        )
        for group in range(groups)
    ]
    try:
        summaries = []
        for group, proc in enumerate(procs):
            out, _ = proc.communicate()
            if proc.returncode != 0:
                raise SystemExit(f"replica group {group} exited with status {proc.returncode}")
            summaries.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            proc.kill()
        lighthouse.shutdown()
    for summary in summaries:
        print(json.dumps(summary), flush=True)
    identical = len({s["state_sha1"] for s in summaries}) == 1
    print(f"replica groups identical at the end: {identical}", flush=True)
    if not identical:
        raise SystemExit(1)
