"""Reconfigurable process groups for the cross-replica-group axis, in every rank.

``collectives`` (the table of collectives: each declared once, every group type derives its
methods from it), ``base`` (the base class and Work types), ``backend`` (a group over a torch
backend, rebuilt on every configure), ``gloo`` and ``nccl`` (its two backends), ``native``
(torch >= 2.14's own reconfigurable group, reconfigured rather than rebuilt), ``baby`` (the
backends in a child process that is killed when a collective hangs), ``wrappers`` (forwarding,
errors as data, routing through the Manager), ``fakes`` (groups for tests), ``store`` (the
quorum's TCPStore), ``futures`` and ``quantized`` (what collectives return and an int8
allreduce), ``lifecycle`` (process-wide state, hooks installed on first use). torchft 0.2.0's
names are importable here.

Names load lazily, on first use: a trainer imports only the group it uses (not the baby
groups' multiprocessing machinery, the fakes or the wrappers).
"""

from torchtitan_ft._lazy import lazy_exports

_PUBLIC = {
    "ProcessGroupBaby": "torchtitan_ft.process_group.baby",
    "ProcessGroupBabyGloo": "torchtitan_ft.process_group.baby",
    "ProcessGroupBabyNCCL": "torchtitan_ft.process_group.baby",
    "GroupConfig": "torchtitan_ft.process_group.base",
    "ProcessGroup": "torchtitan_ft.process_group.base",
    "FakeProcessGroupWrapper": "torchtitan_ft.process_group.fakes",
    "ProcessGroupDummy": "torchtitan_ft.process_group.fakes",
    "ProcessGroupGloo": "torchtitan_ft.process_group.gloo",
    "ProcessGroupNCCL": "torchtitan_ft.process_group.nccl",
    "NativeProcessGroup": "torchtitan_ft.process_group.native",
    "ProcessGroupNativeGloo": "torchtitan_ft.process_group.native",
    "reconfigure_with_store": "torchtitan_ft.process_group.native",
    "ReconfigureOptions": "torchtitan_ft.process_group.base",
    "create_store_client": "torchtitan_ft.process_group.store",
    "parse_store_addr": "torchtitan_ft.process_group.store",
    "ErrorSwallowingProcessGroupWrapper": "torchtitan_ft.process_group.wrappers",
    "ManagedProcessGroup": "torchtitan_ft.process_group.wrappers",
    "ProcessGroupWrapper": "torchtitan_ft.process_group.wrappers",
}

__getattr__ = lazy_exports(__name__, _PUBLIC)


__all__ = sorted(_PUBLIC)
