"""The reconfigurable NCCL process group, in every rank, for CUDA tensors (untested here: no
GPU). Its child-process variant, ``ProcessGroupBabyNCCL``, is in ``baby``."""

from __future__ import annotations

import torch.distributed as dist

from torchtitan_ft.process_group.backend import BackendProcessGroup, torch_group


class ProcessGroupNCCL(BackendProcessGroup):
    """A reconfigurable group over NCCL, for CUDA tensors: :class:`BackendProcessGroup` with
    NCCL as its backend.

    UNTESTED: this platform has no GPU, and ``torch.distributed.ProcessGroupNCCL`` does not
    exist in CPU builds of torch (``configure`` then raises ``RuntimeError``). Timeouts rely on
    the work's future completing, and abort does not call ``ncclCommAbort``.

    Args:
        timeout: bound for building a group in :meth:`configure` and for each collective.
            Default 60 s.
    """

    _BACKEND_NAME = "torchft-nccl"

    def _create_pg(
        self, store: dist.Store, host: str, rank: int, world_size: int
    ) -> dist.ProcessGroup:
        backend_class = getattr(dist, "ProcessGroupNCCL", None)
        if backend_class is None:
            raise RuntimeError("this torch build has no NCCL support")
        backend = backend_class(store, rank, world_size)
        return torch_group(
            store, rank, world_size, dist.ProcessGroup.BackendType.NCCL, "cuda", backend
        )
