"""A heal with no configuration takes the fast link, and finishes on the slow one when the fast
link is pulled mid-heal (issue 37, torchft #329); prints JSON.

    python -m benchmarks.heal_paths [--quick] [--size-mb 500] [--link-mb 100]
        [--fallback-mb 100] [--slow-mbit 100] [--fallback-fast-mbit 1000] [--stall-s 2]

Two test hosts (``torchtitan_ft.testing.netns``, ``links=2``): the donor D and the healer H,
joined by two links. Link 0 (``eth0``) is limited to ``--slow-mbit`` each way (``tc tbf``) and
holds the address the donor's host name resolves to (the donor is given it as ``hostname``, as
a machine whose name resolves to its Ethernet address would advertise); link 1 (``eth1``) is
unlimited. Nothing about paths is configured: the donor offers both (``HTTPTransport``), the
healer probes and picks.

Runs, each healer a fresh process (its probe cache empty), over one donor process:

1. ``links``: each link's rate, measured by a heal of ``--link-mb`` MB pinned to it
   (``interfaces=("eth<k>",)``); the slow link's is what a heal from the host name gets here
   (``torchft_equivalent_rate_mb_s``).
2. ``heal``: a heal of ``--size-mb`` MB with no configuration; ``rate_vs_fast_link`` is its rate
   over the fast link's (goal >= 0.8), and ``path`` what its ``heal_end`` event would record
   (the address, the donor's interface, the probed rate).
3. ``torchft``: torchft 0.2.0's own ``torchft.checkpointing.http_transport.HTTPTransport``
   (``num_chunks=0``, its Manager's default) healing the same ``--size-mb`` MB between the same
   hosts, with no configuration: its donor advertises ``socket.gethostname()``, which here
   answers the donor's link-0 address (a host name that resolves to the slow link; the hosts
   share the machine's own name, so the donor process is told its name that way, and
   torchft's code runs unchanged). ``ours_over_torchft`` is our unconfigured heal's rate over
   its. ``{"skipped": why}`` when the reference is not installed
   (``scripts/install_reference.sh``; ``TORCHFT_REFERENCE_DIR`` points at another checkout's).
4. ``fallback``: a heal of ``--fallback-mb`` MB with no configuration; once 30 % of it crossed
   the fast link, the donor's fast cable is pulled (``Host.disconnect``: packets dropped, no
   reset); the healer notices the stall (``--stall-s``) and restarts on the slow link. The fast
   link is limited to ``--fallback-fast-mbit`` for this run so that the pull lands mid-heal (an
   unlimited one moves the whole state in a fraction of a second). ``finished_on`` must be
   ``eth0``, ``failures`` names the fast path and why.

Rates are MB/s of tensor bytes over the whole ``recv_checkpoint`` (probes included).
``--quick``: 16 MB heals, 8 MB link runs, a 12 MB fallback at 200 Mbit/s (the smoke test).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

from benchmarks import machine
from torchtitan_ft.checkpoint.http_transport import PROBE_BYTES
from torchtitan_ft.testing import netns

GOAL = 0.8
"""The unconfigured heal's rate over the fast link's."""
PULL_AT = 0.3
"""The share of the fallback heal's bytes on the fast link when its cable is pulled."""
TIMEOUT = timedelta(seconds=180)


def _donor(hostname: str) -> None:
    """Runs in D: offers a state of the MB asked on each stdin line, answers its URL."""
    import torch

    from torchtitan_ft.checkpoint import HTTPTransport

    transport: HTTPTransport[Any] = HTTPTransport(TIMEOUT, 0, hostname=hostname)
    for step, line in enumerate(sys.stdin, start=1):
        state = {"w": torch.ones(int(float(line) * 1e6) // 4)}
        transport.send_checkpoint([1], step, state, TIMEOUT)
        print(json.dumps({"step": step, "metadata": transport.metadata()}), flush=True)
    transport.shutdown(wait=False)


def _torchft_donor(hostname: str) -> None:
    """Runs in D: torchft 0.2.0's transport offers a state of the MB asked on each stdin line,
    advertising ``hostname`` as this host's name; answers its URL."""
    import socket

    import torch

    from benchmarks._reference import import_torchft

    import_torchft()
    from torchft.checkpointing.http_transport import HTTPTransport as TorchftTransport

    socket.gethostname = lambda: hostname  # this host's name resolves to link 0's address
    transport = TorchftTransport(TIMEOUT, 0)
    for step, line in enumerate(sys.stdin, start=1):
        state = {"w": torch.ones(int(float(line) * 1e6) // 4)}
        transport.send_checkpoint([1], step, state, TIMEOUT)
        print(json.dumps({"step": step, "metadata": transport.metadata()}), flush=True)
    transport.shutdown(wait=False)


def _torchft_healer(metadata: str, step: int) -> None:
    """Runs in H: one heal with torchft 0.2.0's transport; prints its time and bytes."""
    from urllib.parse import urlsplit

    from benchmarks._reference import import_torchft
    from torchtitan_ft.manager.stats import tensor_bytes

    import_torchft()
    from torchft.checkpointing.http_transport import HTTPTransport as TorchftTransport

    transport = TorchftTransport(TIMEOUT, 0)
    started = time.perf_counter()
    state = transport.recv_checkpoint(1, metadata, step, TIMEOUT)
    seconds = time.perf_counter() - started
    nbytes = tensor_bytes(state)
    print(
        json.dumps(
            {
                "seconds": round(seconds, 3),
                "bytes": nbytes,
                "rate_mb_s": round(nbytes / 1e6 / seconds, 1),
                "address": urlsplit(metadata).hostname,
            }
        )
    )
    transport.shutdown(wait=False)


def _healer(metadata: str, step: int, interfaces: list[str], stall_s: float) -> None:
    """Runs in H: one heal from the donor; prints its time, bytes and path."""
    from torchtitan_ft.checkpoint import HTTPTransport
    from torchtitan_ft.manager.stats import tensor_bytes

    transport: HTTPTransport[Any] = HTTPTransport(
        TIMEOUT,
        0,
        hostname=os.environ["HEAL_PATHS_OWN_HOST"],
        interfaces=interfaces,
        stall_timeout=timedelta(seconds=stall_s),
    )
    started = time.perf_counter()
    state = transport.recv_checkpoint(1, metadata, step, TIMEOUT)
    seconds = time.perf_counter() - started
    nbytes = tensor_bytes(state)
    path = transport.last_path
    assert path is not None
    print(
        json.dumps(
            {
                "seconds": round(seconds, 3),
                "bytes": nbytes,
                "rate_mb_s": round(nbytes / 1e6 / seconds, 1),
                "path": {
                    "address": path.address,
                    "interface": path.interface,
                    "probe_mb_s": None if path.probe_mb_s is None else round(path.probe_mb_s, 1),
                    "failures": list(path.failures),
                },
            }
        )
    )
    transport.shutdown(wait=False)


class _Donor:
    def __init__(self, host: netns.Host, flag: str = "--donor") -> None:
        self.proc = host.popen(
            [sys.executable, "-m", "benchmarks.heal_paths", flag, host.addresses[0]],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def offer(self, mb: float) -> tuple[int, str]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{mb}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the donor ended (exit {self.proc.wait()})")
        answer = json.loads(line)
        return int(answer["step"]), str(answer["metadata"])

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def _heal(
    healer: netns.Host,
    offer: tuple[int, str],
    args: argparse.Namespace,
    interfaces: list[str] = (),  # type: ignore[assignment]
    during: Any = None,
    flag: str = "--healer",
) -> dict[str, Any]:
    step, metadata = offer
    command = [sys.executable, "-m", "benchmarks.heal_paths", flag, metadata, str(step)]
    if flag == "--healer":
        command += ["--stall-s", str(args.stall_s), *(f"--interface={i}" for i in interfaces)]
    proc = healer.popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HEAL_PATHS_OWN_HOST": healer.addresses[0]},
    )
    if during is not None:
        during(proc)
    out, err = proc.communicate(timeout=TIMEOUT.total_seconds() + 60)
    if proc.returncode != 0:
        raise RuntimeError(f"the healer failed (exit {proc.returncode}): {err[-3000:]}")
    return json.loads(out)


def _pull_when(donor: netns.Host, healer: netns.Host, nbytes: float, link: int) -> Any:
    """Pulls the donor's cable of ``link`` once the healer received ``nbytes`` over it."""

    def during(proc: subprocess.Popen[str]) -> None:
        start = healer.bytes_received(link)
        deadline = time.monotonic() + TIMEOUT.total_seconds()
        while healer.bytes_received(link) - start < nbytes:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the heal ended before the fast link could be pulled")
            time.sleep(0.005)
        donor.disconnect(link)

    return during


def _torchft(donor_host: netns.Host, healer_host: netns.Host, args: argparse.Namespace) -> Any:
    """torchft 0.2.0's heal of ``--size-mb`` MB (see the module doc), or why it was skipped."""
    from benchmarks._reference import REFERENCE_DIR, RUNTIME_DEPS_DIR

    if not list(REFERENCE_DIR.glob("torchft/_torchft*.so")) or not RUNTIME_DEPS_DIR.is_dir():
        return {"skipped": f"torchft 0.2.0 is not installed under {REFERENCE_DIR}"}
    donor = _Donor(donor_host, "--torchft-donor")
    try:
        heal = _heal(healer_host, donor.offer(args.size_mb), args, flag="--torchft-healer")
    finally:
        donor.close()
    link = donor_host.addresses.index(heal["address"])
    return {**heal, "interface": netns.interface(link)}


def _cpu() -> dict[str, str]:
    """``lscpu``'s model name and flags (from /proc/cpuinfo)."""
    found: dict[str, str] = {}
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "flags") and key not in found:
                found[key] = value.strip()
    return {"model": found.get("model name", "?"), "flags": found.get("flags", "?")}


def run(args: argparse.Namespace) -> dict[str, Any]:
    with netns.HostNetwork(["D", "H"], links=2) as net:
        donor_host, healer_host = net["D"], net["H"]
        for host in (donor_host, healer_host):
            host.limit(args.slow_mbit, link=0)
        donor = _Donor(donor_host)
        links = {}
        for link in (0, 1):
            name = netns.interface(link)
            links[name] = _heal(healer_host, donor.offer(args.link_mb), args, [name])
        heal = _heal(healer_host, donor.offer(args.size_mb), args)
        torchft = _torchft(donor_host, healer_host, args)
        for host in (donor_host, healer_host):
            host.limit(args.fallback_fast_mbit, link=1)
        # The fast path's probe crosses the link first.
        pull_at = PULL_AT * args.fallback_mb * 1e6 + PROBE_BYTES
        pull = _pull_when(donor_host, healer_host, pull_at, 1)
        fallback = _heal(healer_host, donor.offer(args.fallback_mb), args, during=pull)
        donor.close()
    fast = links["eth1"]["rate_mb_s"]
    return {
        "links": links,
        "heal": {**heal, "rate_vs_fast_link": round(heal["rate_mb_s"] / fast, 3)},
        "heal_took_fast_link": heal["path"]["interface"] == "eth1",
        "torchft_equivalent_rate_mb_s": links["eth0"]["rate_mb_s"],
        "torchft": torchft,
        "ours_over_torchft": round(heal["rate_mb_s"] / torchft["rate_mb_s"], 2)
        if "rate_mb_s" in torchft
        else None,
        "fallback": {
            **fallback,
            "fast_link_mbit": args.fallback_fast_mbit,
            "pulled_at_share": PULL_AT,
            "finished_on": fallback["path"]["interface"],
        },
        "goal": GOAL,
        "goal_met": heal["rate_mb_s"] >= GOAL * fast and heal["path"]["interface"] == "eth1",
        "fallback_finished_on_slow_link": fallback["path"]["interface"] == "eth0"
        and bool(fallback["path"]["failures"]),
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (the smoke test)")
    parser.add_argument("--size-mb", type=float, default=500.0, help="the unconfigured heal")
    parser.add_argument("--link-mb", type=float, default=100.0, help="each pinned link heal")
    parser.add_argument("--fallback-mb", type=float, default=100.0, help="the fallback heal")
    parser.add_argument("--slow-mbit", type=float, default=100.0, help="link 0, Mbit/s")
    parser.add_argument(
        "--fallback-fast-mbit", type=float, default=1000.0, help="link 1 in the fallback run"
    )
    parser.add_argument("--stall-s", type=float, default=2.0, help="the healer's stall timeout")
    parser.add_argument("--donor", metavar="HOSTNAME", help=argparse.SUPPRESS)
    parser.add_argument("--healer", nargs=2, metavar=("METADATA", "STEP"), help=argparse.SUPPRESS)
    parser.add_argument("--interface", action="append", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--torchft-donor", metavar="HOSTNAME", help=argparse.SUPPRESS)
    parser.add_argument(
        "--torchft-healer", nargs=2, metavar=("METADATA", "STEP"), help=argparse.SUPPRESS
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.donor:
        _donor(args.donor)
        return
    if args.healer:
        _healer(args.healer[0], int(args.healer[1]), args.interface, args.stall_s)
        return
    if args.torchft_donor:
        _torchft_donor(args.torchft_donor)
        return
    if args.torchft_healer:
        _torchft_healer(args.torchft_healer[0], int(args.torchft_healer[1]))
        return
    if args.quick:
        args.size_mb, args.link_mb, args.fallback_mb, args.fallback_fast_mbit = 16, 8, 12, 200
    reason = netns.limit_unavailable_reason()
    if reason is not None:
        parser.exit(2, f"{parser.prog}: cannot make hosts here: {reason}\n")
    load_before = os.getloadavg()
    result = run(args)
    print(
        json.dumps(
            {
                "benchmark": "heal_paths",
                "machine": machine(),
                "cpu": _cpu(),
                "command": " ".join(["python -m benchmarks.heal_paths", *sys.argv[1:]]).strip(),
                "size_mb": args.size_mb,
                "slow_link_mbit": args.slow_mbit,
                **result,
                "load_average_1_5_15_at_start": [round(x, 2) for x in load_before],
                "load_average_1_5_15_at_end": [round(x, 2) for x in os.getloadavg()],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
