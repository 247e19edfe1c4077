"""Process-wide state of the process groups, in every rank: the shared gloo devices, the live
groups closed at exit and the objects a forked child must never free.

Nothing happens at import: the exit and fork hooks are installed when the first group is
tracked (``track``; every ``ProcessGroupGloo`` and ``ProcessGroupNCCL`` is). A tracked group is
anything with the two methods of :class:`Tracked`.
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from typing import Any, Protocol

import torch.distributed as dist


class Tracked(Protocol):
    """What this module asks of a group it tracks."""

    def close_at_exit(self) -> None:
        """Free the group now, on this thread (the interpreter is about to finalize)."""

    def forget_after_fork(self) -> None:
        """In a forked child: set aside what was inherited (never free it) and become
        unusable until configured again."""


# One gloo device (transport context with its own event-loop thread) per bind address is
# shared by every group of the process: a device created per group is destroyed with it, and
# tearing groups down on both ends of a connection at once aborted processes here.
_cache_lock = threading.Lock()
_gloo_devices: dict[str, Any] = {}

_live_groups: weakref.WeakSet[Tracked] = weakref.WeakSet()
_hooks_installed = False

_kept_forever: list[object] = []
"""Objects that must never be freed: inherited through fork, or orphaned at interpreter exit."""


def track(pg: Tracked) -> None:
    """Closes ``pg`` at interpreter exit and makes it forget its group in a forked child;
    installs the hooks that do so on first use."""
    global _hooks_installed
    with _cache_lock:
        _live_groups.add(pg)
        if _hooks_installed:
            return
        _hooks_installed = True
    atexit.register(_close_groups_at_exit)
    os.register_at_fork(after_in_child=_after_fork_in_child)


def keep_forever(*objects: object) -> None:
    """Never frees ``objects`` (freeing them would join threads that are gone or hang)."""
    _kept_forever.extend(objects)


def gloo_device(bind: str, interface: str = "") -> Any:
    """The process's gloo device bound to the address ``bind``, else to the network interface
    ``interface``, else gloo's default device (the address of this host's name; it does not
    read ``GLOO_SOCKET_IFNAME``), created on first use."""
    key = bind or (f"interface {interface}" if interface else "")
    with _cache_lock:
        device = _gloo_devices.get(key)
        if device is None:
            if bind:
                device = dist.ProcessGroupGloo.create_device(hostname=bind)
            elif interface:
                device = dist.ProcessGroupGloo.create_device(interface=interface)
            else:
                device = dist.ProcessGroupGloo.create_default_device()
            _gloo_devices[key] = device
        return device


def _close_groups_at_exit() -> None:
    """Free every tracked group while the interpreter is still whole.

    A gloo worker thread that needs the GIL after finalization has begun (e.g. to drop the
    Python callback of a work it just completed) is ended by CPython inside C++ code, which
    aborts the process ("terminate called without an active exception", measured at exit in
    1 of 4 runs of 100 configures). Freeing the groups here joins those threads first.
    """
    for pg in list(_live_groups):
        pg.close_at_exit()


def _after_fork_in_child() -> None:
    """Make the process groups usable in a forked child.

    The child inherits the parent's gloo devices, groups and store connections, but none of
    their threads (and shares the sockets): using them would hang, and freeing them would join
    threads that do not exist. They are set aside for good (a forked multiprocessing child ends
    with ``os._exit``), and every inherited tracked group must be configured again.
    """
    global _cache_lock
    _cache_lock = threading.Lock()
    keep_forever(*_gloo_devices.values())
    _gloo_devices.clear()
    for pg in list(_live_groups):
        pg.forget_after_fork()
