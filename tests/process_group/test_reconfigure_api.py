"""torchft-nightly's reconfigure API on the project's own groups (any torch): every group has
``set_rank_info``, ``get_reconfigure_handle`` and ``reconfigure(ReconfigureOptions)``, and
``reconfigure_with_store`` forms real gloo groups with them, while 0.2.0's ``configure`` keeps
working; a plain torch group without reconfigure support is refused by the Manager's check."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from torchtitan_ft.process_group import (
    ErrorSwallowingProcessGroupWrapper,
    ProcessGroupGloo,
    ReconfigureOptions,
    reconfigure_with_store,
)
from torchtitan_ft.process_group.base import native_reconfigure_available
from torchtitan_ft.process_group.native import (
    NATIVE_MISSING,
    ProcessGroupNativeGloo,
    as_manager_group,
)

T = timedelta(seconds=10)


def _in_threads(fns: list[Any]) -> list[Any]:
    results: list[Any] = [None] * len(fns)

    def run(i: int) -> None:
        try:
            results[i] = fns[i]()
        except Exception as e:  # handed to the test
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results


def _former(pg: Any, prefix: str, rank: int) -> Any:
    """Reconfigures ``pg`` as ``rank`` of 2 through the store at ``prefix``, then allreduces
    its rank + 1: returns the sum and the group's size."""

    def form() -> tuple[float, int]:
        reconfigure_with_store(pg, prefix, rank, 2, T)
        return _allreduce(pg, rank + 1.0), pg.size()

    return form


def _allreduce(pg: Any, value: float) -> float:
    t = torch.tensor([value])
    pg.allreduce([t]).wait()
    return float(t[0])


def test_reconfigure_with_store_forms_the_projects_gloo_groups(store: dist.TCPStore) -> None:
    pgs = [ProcessGroupGloo(T), ErrorSwallowingProcessGroupWrapper(ProcessGroupGloo(T))]
    for i, pg in enumerate(pgs):
        pg.set_rank_info(f"r{i}", 0, 1, i)
    addr = f"127.0.0.1:{store.port}"
    for generation, members in enumerate(([0, 1], [1, 0])):
        results = _in_threads(
            [_former(pgs[i], f"{addr}/g{generation}", members.index(i)) for i in range(2)]
        )
        assert results == [(3.0, 2), (3.0, 2)], results
    # 0.2.0's configure on the same objects still works.
    results = _in_threads(
        [
            lambda i=i: (pgs[i].configure(f"{addr}/old", f"r{i}", i, 2), _allreduce(pgs[i], 1.0))
            for i in range(2)
        ]
    )
    assert [r[1] for r in results] == [2.0, 2.0], results
    for pg in pgs:
        pg.shutdown()


def test_a_handle_names_its_store_and_global_rank_and_is_stable() -> None:
    pg = ProcessGroupGloo(T)
    pg.set_rank_info("r3", 1, 2, global_rank=7)
    handle = json.loads(pg.get_reconfigure_handle())
    assert handle["global_rank"] == 7
    assert handle["store"].startswith("127.0.0.1:")
    assert pg.get_reconfigure_handle() == pg.get_reconfigure_handle()
    assert ProcessGroupGloo(T).get_reconfigure_handle() != pg.get_reconfigure_handle()
    assert pg.supports_reconfigure is True
    assert pg.exchanges_handles() is False  # the Manager configures it over the quorum's store


def test_reconfigure_refuses_a_set_and_handles_without_its_own() -> None:
    pg = ProcessGroupGloo(T)
    other = ProcessGroupGloo(T).get_reconfigure_handle()
    opts = ReconfigureOptions()
    opts.uuid = 1
    opts.handles = {other}
    with pytest.raises(ValueError, match="as a list"):
        pg.reconfigure(opts)
    opts.handles = [other]
    with pytest.raises(ValueError, match="do not include this rank"):
        pg.reconfigure(opts)


def test_a_plain_torch_group_without_reconfigure_is_refused_ours_pass() -> None:
    plain = dist.ProcessGroup(dist.HashStore(), 0, 1)
    with pytest.raises(ValueError, match="enable_reconfigure=True"):
        as_manager_group(plain, T)
    ours = ProcessGroupGloo(T)
    assert as_manager_group(ours, T) is ours


@pytest.mark.skipif(native_reconfigure_available(), reason="this torch has native reconfigure")
def test_the_native_group_is_refused_in_one_line_on_an_older_torch(store: dist.TCPStore) -> None:
    with pytest.raises(RuntimeError) as info:
        ProcessGroupNativeGloo(f"127.0.0.1:{store.port}/native", 0, 1, T)
    message = str(info.value)
    assert message == NATIVE_MISSING.format(version=torch.__version__)
    assert torch.__version__ in message and "torch>=2.14" in message and "\n" not in message
