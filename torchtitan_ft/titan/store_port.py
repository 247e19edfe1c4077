"""The port of a replica group's worker store (``MASTER_PORT``), picked so that nothing takes it
before the workers bind it.

torchrun picks that port on the group's node 0 when every rendezvous round gets a new store
(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which ``titan.launch`` sets): a bind to port 0,
closed at once (``get_free_port``); group rank 0 binds it seconds later, after its imports. A
port 0 bind and every outgoing connection of the machine draw from the same ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``), so on a busy machine another process took the
port in between now and then, and the group failed (``EADDRINUSE``).

:func:`pick` takes the port from outside the ephemeral range instead, where the kernel hands
out no port by itself, and claims it for the launcher's lifetime with an abstract Unix socket
named after it: a concurrent pick (another replica group, another test) skips a claimed port,
and the claim goes away with the launcher, however it ends. A port something listens on is
skipped too.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

from torchtitan_ft.netaddr import port_in_use

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_CLAIM_PREFIX = "\0torchtitan_ft/store_port/"
_ATTEMPTS = 200
_MIN_CANDIDATES = 1024
_claim: socket.socket | None = None  # this launcher's: its current group's store port


def ephemeral_range(text: str) -> tuple[int, int]:
    """The ephemeral port range, first and last, from the text of ``ip_local_port_range``
    (``"32768\\t60999\\n"``). Pure."""
    first, last = (int(field) for field in text.split())
    return first, last


def candidates(first: int, last: int) -> range:
    """Ports outside the ephemeral range ``first``..``last``: above it when at least
    ``_MIN_CANDIDATES`` ports are there (clear of the usual fixed ports: torchrun's 29500, the
    lighthouse's 29510), else below it down to 1024 (the first unprivileged port). Empty when
    the range leaves fewer than that on both sides. Pure."""
    above = range(last + 1, 65536)
    if len(above) >= _MIN_CANDIDATES:
        return above
    below = range(1024, first)
    return below if len(below) >= _MIN_CANDIDATES else range(0)


def pick(rng: random.Random | None = None) -> int | None:
    """A free port outside the ephemeral range, claimed by this process until its next pick or
    its exit; None when there is no such range here or every try was taken (the caller then
    falls back to a port 0 bind)."""
    global _claim
    try:
        ports = candidates(*ephemeral_range(EPHEMERAL_RANGE_FILE.read_text()))
    except (OSError, ValueError):  # not Linux, or a file of another shape
        return None
    if not ports:
        return None
    rng = rng or random.Random()
    for _ in range(_ATTEMPTS):
        port = rng.choice(ports)
        claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            claim.bind(f"{_CLAIM_PREFIX}{port}")
        except OSError:  # claimed by a concurrent pick
            claim.close()
            continue
        if port_in_use("0.0.0.0", port) or port_in_use("::", port):
            claim.close()
            continue
        if _claim is not None:  # the previous round's store is gone with its workers
            _claim.close()
        _claim = claim
        return port
    return None


def install() -> None:
    """Makes torchrun's agent in this process pick its worker store port with :func:`pick`
    (falling back to its own ``get_free_port``)."""
    from torch.distributed.elastic.rendezvous import api  # load order: launch imports us torch-free

    original = api.get_free_port
    if getattr(original, "picks_outside_ephemeral", False):
        return

    def get_free_port() -> int:
        port = pick()
        return original() if port is None else port

    get_free_port.picks_outside_ephemeral = True  # type: ignore[attr-defined]
    api.get_free_port = get_free_port
