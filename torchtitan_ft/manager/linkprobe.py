"""The link probe: a replica group times a round trip of a fixed payload to the lighthouse, so
that the lighthouse can tell a group held back by its own slow link (``lighthouse.stragglers``).

Why a probe: the cross-group all-reduce moves at the pace of its slowest link and holds every
group to it, so every group's step and compute times are the same whichever link is slow; no
timing of the step names the group. A probe measures one link: the group's ManagerServer sends
``probe_bytes`` zeros to the lighthouse (``LinkProbe``) and gets as many back, and reports the
call's seconds with its next quorum request (``GroupProgress.link_probes``). The lighthouse
compares the groups' probes as it compares their compute. Every probe also crosses the
lighthouse's own link, which is the same for all groups.

The lighthouse decides the payload and the interval (``--straggler_link_probe_bytes``,
``--straggler_link_probe_interval_ms``): the first call sends nothing and learns them, every
answer repeats them. A probe runs on a thread of its own, started right after a quorum (while
the group computes its forward and backward, before its cross-group traffic), at most one at a
time, at most one per quorum and one per interval. A left-out group (straggler policy) keeps
asking for quorums, so its link keeps being probed, and it is taken back when fast again.
torchft 0.2.0's lighthouse has no ``LinkProbe``: the first call says so (UNIMPLEMENTED) and the
group stops probing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from enum import StrEnum

import grpc

from torchtitan_ft.lighthouse.client import LighthouseClient
from torchtitan_ft.proto import torchft_pb2 as pb

logger = logging.getLogger(__name__)

OFF_RECHECK_S = 60.0
"""While the lighthouse wants no probes (``probe_bytes`` 0), how often the group asks again."""
PROBE_TIMEOUT_S = 60.0
"""Longest a probe may take: 2 x 512 KiB at about 0.15 Mbit/s. A slower one is lost (no
sample) and the next is tried an interval later."""
MAX_PENDING = 64
"""Probe results kept for the next quorum request; older ones are dropped (a group that asks
for no quorum for that long is not being judged anyway)."""


class ProbeAction(StrEnum):
    """What the prober does when kicked after a quorum."""

    WAIT = "wait"
    """Nothing: a probe ran less than an interval ago."""
    ASK = "ask"
    """Send an empty probe: learn the lighthouse's settings (first call, or probes are off)."""
    PROBE = "probe"
    """Send ``probe_bytes`` and time the round trip."""


def probe_action(
    probe_bytes: int | None, interval_s: float, last_start: float | None, now: float
) -> ProbeAction:
    """The prober's next step (pure). ``probe_bytes``: the lighthouse's payload size, None
    before its first answer; ``last_start``: when the last call started (None: never)."""
    if probe_bytes is None:
        return ProbeAction.ASK
    wait = interval_s if probe_bytes > 0 else OFF_RECHECK_S
    if last_start is not None and now - last_start < wait:
        return ProbeAction.WAIT
    return ProbeAction.PROBE if probe_bytes > 0 else ProbeAction.ASK


class LinkProber:
    """Times this group's link to the lighthouse now and then, on a daemon thread of its own.

    Args:
        lighthouse: the client whose channel the probes use (``LighthouseClient.link_probe``,
            with its job token; the ManagerServer's heartbeat client, whose stream carries a
            few bytes per interval: a probe's payload shares that connection, not the quorum
            requests', which run on the server's event loop over a channel of their own).
            The caller closes it after ``close``.
        replica_id: this group's id, sent with each probe.
        clock: monotonic seconds (tests may pass their own).
    """

    def __init__(
        self,
        lighthouse: LighthouseClient,
        replica_id: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._replica_id = replica_id
        self._lighthouse = lighthouse
        self._call_in_flight: grpc.Future | None = None
        self._clock = clock
        self._kicked = threading.Event()
        self._lock = threading.Lock()
        self._results: list[pb.LinkProbeResult] = []
        self._closed = False
        self._thread: threading.Thread | None = None
        self.probe_bytes: int | None = None
        """The lighthouse's payload size (None: not known yet)."""
        self.interval_s = 0.0
        self._last_start: float | None = None
        self._seq = 0
        self._failed_logged = False

    def kick(self) -> None:
        """A quorum was issued: probe now if one is due (never blocks)."""
        if self._closed:
            return
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"link-probe-{self._replica_id}", daemon=True
            )
            self._thread.start()
        self._kicked.set()

    def take(self) -> list[pb.LinkProbeResult]:
        """The probes that ended since the last call, oldest first."""
        with self._lock:
            results, self._results = self._results, []
        return results

    def close(self) -> None:
        """Stops probing (a probe in flight is cancelled)."""
        with self._lock:
            self._closed = True
            call = self._call_in_flight
        self._kicked.set()
        if call is not None:
            call.cancel()

    def _run(self) -> None:
        while True:
            self._kicked.wait()
            self._kicked.clear()
            if self._closed:
                return
            now = self._clock()
            action = probe_action(self.probe_bytes, self.interval_s, self._last_start, now)
            if action is ProbeAction.WAIT:
                continue
            self._last_start = now
            size = self.probe_bytes if action is ProbeAction.PROBE else 0
            if not self._call(size or 0):
                return

    def _call(self, size: int) -> bool:
        """One probe of ``size`` bytes each way; False: stop probing for good."""
        with self._lock:
            if self._closed:
                return False
            start = time.perf_counter()
            call = self._lighthouse.link_probe(self._replica_id, size, PROBE_TIMEOUT_S)
            self._call_in_flight = call
        try:
            response = call.result()
        except grpc.FutureCancelledError:
            return False
        except grpc.RpcError as e:
            if self._closed:
                return False
            if e.code() is grpc.StatusCode.UNIMPLEMENTED:
                logger.info(
                    "replica %s: the lighthouse has no LinkProbe (torchft's): this group's link "
                    "is not probed, and a slow link of its own is not reported",
                    self._replica_id,
                )
                return False
            if not self._failed_logged:
                self._failed_logged = True
                logger.warning(
                    "replica %s: a link probe failed (%s: %s); probing goes on, this is "
                    "logged once",
                    self._replica_id,
                    e.code(),
                    e.details(),
                )
            return True
        seconds = time.perf_counter() - start
        self.probe_bytes, self.interval_s = response.probe_bytes, response.interval_ms / 1000
        if size > 0:
            self._seq += 1
            moved = size + len(response.payload)
            with self._lock:
                self._results.append(
                    pb.LinkProbeResult(seq=self._seq, bytes=moved, seconds=seconds)
                )
                del self._results[:-MAX_PENDING]
        return True
