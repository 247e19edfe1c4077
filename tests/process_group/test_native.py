"""torch's native reconfigurable gloo (torch >= 2.14) as the cross-group group: real gloo
groups of three members in threads, re-formed with their handles as membership changes; a
hung collective's abort; torchft-nightly's ``reconfigure_with_store`` on a plain torch group;
and two Managers on a real lighthouse driving plain torch groups created with
``enable_reconfigure=True``, their handles exchanged through the quorum (fields 7, 9 and 14).
The SIGKILLed peer is measured by ``benchmarks.native_pg``."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.manager.test_manager import UserState, _manager
from tests.process_group.test_reconfigure_api import _allreduce, _in_threads
from torchtitan_ft.lighthouse import LighthouseServer
from torchtitan_ft.process_group import (
    ProcessGroupGloo,
    ReconfigureOptions,
    reconfigure_with_store,
)
from torchtitan_ft.process_group.base import native_reconfigure_available
from torchtitan_ft.process_group.native import NativeProcessGroup, ProcessGroupNativeGloo

pytestmark = pytest.mark.skipif(
    not native_reconfigure_available(),
    reason=f"torch {torch.__version__} has no native reconfigure (enable_reconfigure needs "
    "torch>=2.14): run with /tmp/t214 or /tmp/t215's python",
)

T = timedelta(seconds=10)


def _native_groups(store: dist.TCPStore, n: int) -> list[ProcessGroupNativeGloo]:
    return [ProcessGroupNativeGloo(f"127.0.0.1:{store.port}/native", r, n, T) for r in range(n)]


def _reconfigure(pgs: list[Any], members: list[int], uuid: int) -> list[Any]:
    """Re-forms ``members`` (indexes into ``pgs``) in that rank order, then each allreduces
    its index + 1; returns each member's (sum, rank, size)."""
    handles = [pgs[m].get_reconfigure_handle() for m in members]

    def form(pg: Any) -> tuple[float, int, int]:
        opts = ReconfigureOptions()
        opts.uuid = uuid
        opts.handles = handles
        pg.reconfigure(opts).wait()
        return _allreduce(pg, pgs.index(pg) + 1.0), pg.rank(), pg.size()

    return _in_threads([lambda pg=pgs[m]: form(pg) for m in members])


def test_three_groups_reconfigure_as_members_leave_and_return(store: dist.TCPStore) -> None:
    pgs = _native_groups(store, 3)
    assert len({pg.get_reconfigure_handle() for pg in pgs}) == 3
    assert _reconfigure(pgs, [0, 1, 2], 1) == [(6.0, 0, 3), (6.0, 1, 3), (6.0, 2, 3)]
    assert _reconfigure(pgs, [2, 0], 2) == [(4.0, 0, 2), (4.0, 1, 2)]
    assert _reconfigure(pgs, [1, 2, 0], 3) == [(6.0, 0, 3), (6.0, 1, 3), (6.0, 2, 3)]
    for pg in pgs:
        pg.shutdown()


def test_abort_releases_a_hung_collective_and_the_survivors_go_on(store: dist.TCPStore) -> None:
    pgs = _native_groups(store, 3)
    _reconfigure(pgs, [0, 1, 2], 1)
    works = [pgs[i].allreduce([torch.ones(1)]) for i in (0, 1)]  # group 2 never joins
    time.sleep(0.2)
    started = time.monotonic()
    for pg in pgs[:2]:
        pg.abort()
    for work in works:
        with pytest.raises(RuntimeError, match="aborted"):
            work.wait()
    assert time.monotonic() - started < T.total_seconds() / 2  # not gloo's own timeout
    assert all(pg.errored() is not None for pg in pgs[:2])
    assert _reconfigure(pgs, [0, 1], 2) == [(3.0, 0, 2), (3.0, 1, 2)]
    assert [pg.errored() for pg in pgs[:2]] == [None, None]


def test_a_reconfigure_without_its_own_handle_is_refused(store: dist.TCPStore) -> None:
    pgs = _native_groups(store, 2)
    opts = ReconfigureOptions()
    opts.uuid = 1
    opts.handles = [pgs[1].get_reconfigure_handle()]
    with pytest.raises(ValueError, match="do not include this rank"):
        pgs[0].reconfigure(opts)


def _plain_native(store: dist.TCPStore, rank: int, world_size: int) -> dist.ProcessGroup:
    """A plain torch group as torchft-nightly's users make one: gloo, enable_reconfigure."""
    prefixed = dist.PrefixStore("plain", store)
    pg = dist.ProcessGroup(prefixed, rank, world_size)
    backend = dist.ProcessGroupGloo(prefixed, rank, world_size, T, enable_reconfigure=True)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return pg


def test_reconfigure_with_store_on_plain_torch_groups(store: dist.TCPStore) -> None:
    clients = [dist.TCPStore("127.0.0.1", store.port, is_master=False) for _ in range(2)]
    pgs = [_plain_native(clients[r], r, 2) for r in range(2)]
    addr = f"127.0.0.1:{store.port}"

    def form(r: int) -> float:
        reconfigure_with_store(pgs[r], f"{addr}/helper", r, 2, T)
        t = torch.tensor([r + 1.0])
        pgs[r].allreduce([t]).wait()
        return float(t[0])

    assert _in_threads([lambda r=r: form(r) for r in range(2)]) == [3.0, 3.0]


@pytest.fixture
def lighthouse2() -> Iterator[LighthouseServer]:
    server = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=5000, heartbeat_timeout_ms=2000
    )
    yield server
    server.shutdown()


def test_managers_drive_plain_torch_groups_through_the_quorum(
    lighthouse2: LighthouseServer, store: dist.TCPStore
) -> None:
    clients = [dist.TCPStore("127.0.0.1", store.port, is_master=False) for _ in range(2)]
    pgs = [_plain_native(clients[r], r, 2) for r in range(2)]
    users = [UserState(float(r)) for r in range(2)]
    managers = [
        _manager(lighthouse2, f"n{r}", user=users[r], pg=pgs[r], init_sync=False) for r in range(2)
    ]
    try:
        assert all(isinstance(m._pg, NativeProcessGroup) for m in managers)
        for step in range(3):
            tensors = [torch.full((4,), float(r + step)) for r in range(2)]
            for m in managers:
                m.start_quorum()
            threads = [
                threading.Thread(target=lambda m=m, t=t: m.allreduce(t).wait())
                for m, t in zip(managers, tensors, strict=True)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=30)
            votes = _in_threads([m.should_commit for m in managers])
            assert votes == [True, True], [m.errored() for m in managers]
            expected = torch.full((4,), step + 0.5)
            assert all(torch.equal(t, expected) for t in tensors), tensors
        assert [m.current_step() for m in managers] == [3, 3]
    finally:
        for m in managers:
            m.shutdown()


def test_a_native_group_beside_a_group_without_handles_fails_the_step_clearly(
    lighthouse2: LighthouseServer, store: dist.TCPStore
) -> None:
    """A quorum whose other member sent no handle (the project's own group here; a torchft
    0.2.0 group or lighthouse alike): the native group's reconfigure is refused with the
    counts, the step is discarded on both, nothing hangs past the timeouts."""
    short = timedelta(seconds=3)
    native = _plain_native(dist.TCPStore("127.0.0.1", store.port, is_master=False), 0, 2)
    managers = [
        _manager(lighthouse2, "n0", pg=native, init_sync=False, timeout=short),
        _manager(lighthouse2, "g1", pg=ProcessGroupGloo(short), init_sync=False, timeout=short),
    ]
    try:
        for m in managers:
            m.start_quorum()
        votes = _in_threads([m.should_commit for m in managers])
        assert votes == [False, False]
        error = str(managers[0].errored())
        assert "carries 0 reconfigure handles for 2 members" in error, error
    finally:
        for m in managers:
            m.shutdown()
