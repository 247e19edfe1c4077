"""The reconfigurable gloo process group, in every rank: CPU collectives across replica groups,
each returning a Work that gives up at the group's timeout.

Facts about gloo in torch 2.13 that shaped this module (measured on CPU, loopback, 2 cores):

- A SIGKILLed peer surfaces on every survivor as "Connection closed by peer" / "Connection reset
  by peer" within milliseconds (13-110 ms from the kill under heavy load), in the collective in
  flight and in every later one on that group. A peer that drops its group does the same.
- A peer that is alive but never joins a collective is only noticed at gloo's own timeout.
  ``abort()`` and ``shutdown()`` of the gloo backend return at once but do **not** unblock such
  a collective, and dropping the last reference to the group blocks the caller until the hung
  collective times out (the destructor joins gloo's worker threads). So :meth:`abort` here
  completes the pending works with an error itself (the waiter is released at once) and frees
  the old group on a helper thread, which does not hold the GIL while it waits.
- If a peer dies before the group is built, construction waits for it until the store timeout
  and raises ``DistStoreError``; a store that cannot be reached takes about twice the timeout
  (the TCPStore client retries). :meth:`ProcessGroupGloo.configure` therefore builds under a
  hard deadline.
- Freeing a gloo group on one of its own worker threads (where a completed work's Python
  callback may hold the last reference) aborts the process ("Resource deadlock avoided"), and
  so does a gloo thread that needs the GIL after interpreter finalization began. Groups are
  therefore always freed on a helper thread, after gloo is done with their works, and closed
  at exit (``lifecycle``).
- gloo supports ``ReduceOp.AVG`` natively in torch 2.13 (allreduce and reduce_scatter); it
  rejects ``PREMUL_SUM``. Its reduce_scatter, send and recv works have no future.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist

from torchtitan_ft.addresses import GLOO_SOCKET_IFNAME_ENV, gloo_bind_address
from torchtitan_ft.process_group import lifecycle
from torchtitan_ft.process_group.backend import BackendProcessGroup, torch_group


class ProcessGroupGloo(BackendProcessGroup):
    """A gloo process group rebuilt on every :meth:`configure`: :class:`BackendProcessGroup`
    with gloo as its backend (every collective gives up at the timeout; errors are raised, and
    recorded in :meth:`errored` until the next ``configure``).

    The gloo transport binds 127.0.0.1 when the store host is a loopback address; otherwise
    the interface ``GLOO_SOCKET_IFNAME`` names, else the pinned heal interface
    (``heal_interfaces``, else ``TORCHFT_HEAL_INTERFACES``), else a link faster than the
    route's that the store answers from, else this host's address on the route towards the store
    (:func:`torchtitan_ft.addresses.gloo_address`; said in one log line). All groups of the
    process share one gloo device (``lifecycle``).

    Args:
        timeout: bound for building a group in :meth:`configure` (store connection and
            rendezvous with every peer) and for each collective (gloo's own timeout and
            ``Work.wait()``). Default 60 s.
        heal_interfaces: the interfaces the operator pinned heals to (the group listens on
            the first one the store's host answers from, where ``GLOO_SOCKET_IFNAME`` is
            unset); ``None``: ``TORCHFT_HEAL_INTERFACES``, if set. The TorchTitan plugin
            passes ``fault_tolerance.heal_interfaces`` (else that variable).
    """

    _BACKEND_NAME = "torchft-gloo"

    def __init__(
        self,
        timeout: timedelta = timedelta(seconds=60),
        heal_interfaces: Sequence[str] | None = None,
    ) -> None:
        super().__init__(timeout)
        self._heal_interfaces = None if heal_interfaces is None else tuple(heal_interfaces)

    def _create_pg(
        self, store: dist.Store, host: str, rank: int, world_size: int
    ) -> dist.ProcessGroup:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = self._timeout
        # Peers dial the address the device binds: loopback when the store is on loopback
        # (then every peer is on this host), else GLOO_SOCKET_IFNAME's interface, else the
        # heal's rule (addresses.gloo_address: the pin, a faster link, the route towards the
        # store; gloo's default, the address of this machine's name, is often loopback and
        # would be told to peers on other machines).
        bind = gloo_bind_address(host, os.environ, self._heal_interfaces)
        interface = "" if bind else os.environ.get(GLOO_SOCKET_IFNAME_ENV, "").split(",")[0]
        options._devices = [lifecycle.gloo_device(bind or "", interface)]
        backend = dist.ProcessGroupGloo(store, rank, world_size, options)
        return torch_group(
            store, rank, world_size, dist.ProcessGroup.BackendType.GLOO, "cpu", backend
        )
