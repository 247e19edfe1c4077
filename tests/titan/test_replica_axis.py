"""The FT seams: data slice per replica group, FSDP gradient hook, null object when FT is off,
one interface for every replica axis."""

import dataclasses
import threading

import pytest
import torch

from torchtitan_ft.titan import cpu_compat
from torchtitan_ft.titan.replica_axis import (
    ManagedReplicaAxis,
    ManagerRuntime,
    NoReplicaAxis,
    OverlappedGradientSync,
    ReplicaAxis,
    ReplicaSlice,
    UnitReduction,
    build_replica_axis,
    has_fsdp,
    install_replica_allreduce_hook,
    model_config_fingerprint,
    overlap_blocker,
    replica_dataloader_shard,
    shard_on_single_rank,
    unit_reduction,
)


def test_dataloader_slices_tile_the_dataset_without_overlap() -> None:
    dp_degree, group_size = 2, 3
    slices = [
        replica_dataloader_shard(dp_degree, dp_rank, replica_id, group_size)
        for replica_id in range(group_size)
        for dp_rank in range(dp_degree)
    ]
    assert {world for world, _ in slices} == {6}
    assert [rank for _, rank in slices] == list(range(6))  # same order as native HSDP ranks


@pytest.mark.parametrize(("dp_rank", "replica_id"), [(2, 0), (-1, 0), (0, 3), (0, -1)])
def test_dataloader_slice_rejects_out_of_range(dp_rank: int, replica_id: int) -> None:
    with pytest.raises(ValueError, match="must be in"):
        replica_dataloader_shard(2, dp_rank, replica_id, 3)


def test_disabled_axis_is_identity() -> None:
    from torchtitan_ft.titan.config import JobConfig

    axis = build_replica_axis(JobConfig())
    assert isinstance(axis, NoReplicaAxis) and not axis.enabled
    spec, loader, optimizers, schedulers = object(), object(), object(), object()
    assert axis.train_spec(spec) is spec
    assert axis.install_gradient_sync([torch.nn.Linear(2, 2)]) == 0
    assert axis.track_data(loader) is loader
    assert axis.gate_step(optimizers, schedulers) == (optimizers, schedulers)
    assert axis.step_committed()


class _Stub:
    """Records the calls of the Manager and process group a ``ManagerRuntime`` holds."""

    def __init__(self, calls: list[str], name: str) -> None:
        self.calls, self.name = calls, name

    def shutdown(self, wait: bool = True) -> None:
        self.calls.append(f"{self.name}.shutdown")

    def register_state_dict_fn(self, key: str, load, save) -> None:
        self.calls.append(f"{self.name}.register_state_dict_fn({key})")


def _managed_axis(calls: list[str]) -> ManagedReplicaAxis:
    runtime = ManagerRuntime(_Stub(calls, "manager"), _Stub(calls, "pg"))
    return ManagedReplicaAxis(runtime, ReplicaSlice(replica_id=1, group_size=2))


def test_every_axis_implements_the_trainers_interface() -> None:
    from torchtitan_ft.semi_sync import SyncConfig, SyncMethod
    from torchtitan_ft.semi_sync.config import QuorumMode
    from torchtitan_ft.titan.semi_sync_axis import SemiSyncReplicaAxis

    local_sgd = SyncConfig(method=SyncMethod.LOCAL_SGD, quorum_mode=QuorumMode.SYNC)
    runtime = ManagerRuntime(_Stub([], "manager"), _Stub([], "pg"))
    axes = [
        NoReplicaAxis(),
        _managed_axis([]),
        SemiSyncReplicaAxis(runtime, ReplicaSlice(0, 2), local_sgd),
    ]
    for axis in axes:
        assert isinstance(axis, ReplicaAxis), type(axis).__name__
    assert [(a.enabled, a.replica_id, a.group_size) for a in axes] == [
        (False, 0, 1),
        (True, 1, 2),
        (True, 0, 2),
    ]


def test_per_step_builder_points_semi_sync_jobs_to_their_builder() -> None:
    from torchtitan_ft.titan.config import JobConfig

    config = JobConfig()
    config.fault_tolerance.enable = True
    config.fault_tolerance.semi_sync_method = "diloco"
    with pytest.raises(ValueError, match=r"semi_sync_method='diloco'.*build_semi_sync_axis"):
        build_replica_axis(config)


def test_train_spec_wraps_dataloader_with_replica_offset() -> None:
    from torchtitan.protocols.train_spec import get_train_spec

    calls = []

    def build_dataloader(*, dp_world_size, dp_rank, tokenizer, job_config):
        calls.append((dp_world_size, dp_rank))

    base = dataclasses.replace(get_train_spec("llama3"), build_dataloader_fn=build_dataloader)
    spec = ReplicaSlice(replica_id=1, group_size=2).train_spec(base)
    spec.build_dataloader_fn(dp_world_size=2, dp_rank=1, tokenizer=None, job_config=None)
    assert calls == [(4, 3)]
    assert spec.model_cls is base.model_cls


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    model(torch.ones(4, 8)).sum().backward()
    return [
        p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        for p in model.parameters()
    ]


@pytest.mark.usefixtures("single_rank_group")
def test_hook_reaches_single_rank_fsdp_gradients_in_place() -> None:
    expected = _grads(_model())
    model = shard_on_single_rank(_model(), "cpu")
    assert has_fsdp(model)
    assert cpu_compat.force_sum_reduction([model]) == 1
    seen = []

    def halve(grad: torch.Tensor) -> None:
        seen.append(grad.numel())
        grad.mul_(0.5)

    assert install_replica_allreduce_hook([model], halve) == 1
    for got, want in zip(_grads(model), expected, strict=True):
        torch.testing.assert_close(got, want * 0.5)
    assert seen  # called on the flat gradient of the FSDP unit


_FP32 = torch.float32
_OVERLAP_CASES = [
    # (what FSDP does after the hook, blocked?)
    (UnitReduction("cpu", 1.0, True, _FP32, _FP32), None),  # TorchTitan on gloo
    (UnitReduction("cpu", None, False, _FP32, _FP32), None),  # AVG in the collective
    (UnitReduction("cpu", 1.0, False, torch.float16, torch.float16), None),
    (UnitReduction("cpu", None, True, _FP32, _FP32), "divides"),
    (UnitReduction("cpu", 2.0, True, _FP32, _FP32), "divides"),
    (UnitReduction("cpu", None, False, torch.float16, torch.float16), "divides"),
    (UnitReduction("cpu", 1.0, True, _FP32, torch.bfloat16), "casts"),
    (UnitReduction("cpu", 1.0, True, _FP32, _FP32, offload=True), "copies"),
    (UnitReduction("cpu", 1.0, True, _FP32, _FP32, accumulating=True), "accumulation"),
    (UnitReduction("cpu", 1.0, True, _FP32, _FP32, grad_hooks=True), "post-accumulate"),
    (UnitReduction("cuda:0", 1.0, False, _FP32, _FP32), "already asynchronous"),
]


@pytest.mark.parametrize(("unit", "blocked_because"), _OVERLAP_CASES)
def test_overlap_only_where_fsdp_leaves_the_shard_alone(
    unit: UnitReduction, blocked_because: str | None
) -> None:
    reason = overlap_blocker(unit)
    if blocked_because is None:
        assert reason is None
    else:
        assert reason is not None and blocked_because in reason


@pytest.mark.usefixtures("single_rank_group")
@pytest.mark.parametrize(
    ("reduce_dtype", "expected"),
    [(None, (_FP32, _FP32)), (torch.bfloat16, (torch.bfloat16, _FP32))],
)
def test_unit_reduction_reads_a_real_fsdp_units_dtypes(
    reduce_dtype: torch.dtype | None, expected: tuple[torch.dtype, torch.dtype]
) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _model()
    policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)), mp_policy=policy)
    model(torch.ones(4, 8)).sum().backward()  # FSDP sets its dtypes at its lazy init
    unit = unit_reduction(model, "cpu")
    assert (unit.reduce_dtype, unit.orig_dtype) == expected
    assert unit.accumulating  # the backward left gradients


def _two_units() -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    mesh = init_device_mesh("cpu", (1,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    cpu_compat.force_sum_reduction([model])
    for unit in (model[0], model):
        unit.set_gradient_divide_factor(1.0)
    return model


class _HeldAllReduce:
    """A cross-group all-reduce stand-in that halves each shard on its own thread, and only
    once every FSDP unit's all-reduce has started (or after 10 s): a hook that waits for its
    all-reduce stalls the next unit's, and the recorded order shows it."""

    def __init__(self, units: int) -> None:
        self.units = units
        self.order: list[str] = []
        self._all_started = threading.Event()

    def start(self, shard: torch.Tensor) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        self.order.append("start")
        if self.order.count("start") >= self.units:
            self._all_started.set()
        threading.Thread(target=self._finish, args=(shard, future), daemon=True).start()
        return future

    def _finish(self, shard: torch.Tensor, future: torch.futures.Future) -> None:
        self._all_started.wait(timeout=10.0)
        shard.mul_(0.5)
        self.order.append("done")
        future.set_result(shard)


@pytest.mark.usefixtures("single_rank_group")
def test_unit_allreduces_overlap_the_backward_and_finish_before_it_returns() -> None:
    expected = _grads(_model())
    model = _two_units()
    held = _HeldAllReduce(units=2)
    sync = OverlappedGradientSync(held.start, "cpu")
    assert sync.install([model]) == 2
    grads = _grads(model)  # backward() returns after the final callback waited
    assert held.order[:2] == ["start", "start"]  # the second began before the first ended
    assert (sync.overlapped, sync.waited_in_hook) == (2, 0)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want * 0.5)


@pytest.mark.usefixtures("single_rank_group")
def test_accumulated_gradients_wait_in_the_hook() -> None:
    expected = _grads(_model())
    model = _two_units()
    sync = OverlappedGradientSync(_HeldAllReduce(units=1).start, "cpu")
    sync.install([model])
    _grads(model)
    grads = _grads(model)  # no zero_grad: FSDP adds into the gradients of the first pass
    assert (sync.overlapped, sync.waited_in_hook) == (2, 2)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want)  # 0.5 + 0.5


def test_enabled_axis_refuses_a_model_without_fsdp() -> None:
    with pytest.raises(RuntimeError, match="no FSDP module"):
        _managed_axis([]).install_gradient_sync([_model()])


def test_replica_slice_rejects_an_id_outside_the_group() -> None:
    with pytest.raises(ValueError, match=r"replica_id=2 must be in \[0, group_size=2\)"):
        ReplicaSlice(replica_id=2, group_size=2)


def test_healed_state_is_registered_and_shutdown_runs_once() -> None:
    calls: list[str] = []
    axis = _managed_axis(calls)
    axis.register_state(torch.nn.Linear(1, 1))  # any Stateful
    axis.shutdown()
    axis.shutdown()
    assert calls == [
        "manager.register_state_dict_fn(torchtitan)",
        "manager.shutdown",
        "pg.shutdown",
    ]


def test_model_config_fingerprint_follows_the_model_config() -> None:
    from torchtitan_ft.titan.config import JobConfig

    config = JobConfig()
    config.model.name, config.model.flavor = "llama3", "debugmodel"
    first = model_config_fingerprint(config)
    assert first == model_config_fingerprint(config)
    assert " params / " in first
    config.model.flavor = "debugmodel_flex_attn"  # another attention, the same weights
    assert model_config_fingerprint(config) == first
    config.model.flavor = "8B"  # built on the meta device: no memory
    assert model_config_fingerprint(config) != first


@pytest.mark.parametrize(
    ("field", "variable", "pinned"),
    [
        ("ib1", "ib0", ("ib1",)),  # the field wins, as for the heal
        ("", "ib0,eth1", ("ib0", "eth1")),
        ("", "", ()),
    ],
)
def test_the_cross_group_gloo_group_takes_the_heal_pin(
    field: str, variable: str, pinned: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plugin hands its gloo group the heal pin it resolved (the field, else
    ``TORCHFT_HEAL_INTERFACES``): the group listens on the pinned link as the heal does
    (``addresses.gloo_address``; on two test hosts: test_gloo_address_netns.py)."""
    from torchtitan_ft.process_group import ProcessGroupGloo
    from torchtitan_ft.titan.config import parse_job_config
    from torchtitan_ft.titan.replica_axis import cross_group_pg

    monkeypatch.setenv("TORCHFT_HEAL_INTERFACES", variable)
    flags = ["--fault_tolerance.enable", "--fault_tolerance.group_size=2"]
    if field:
        flags.append(f"--fault_tolerance.heal_interfaces={field}")
    pg = cross_group_pg(parse_job_config(flags).fault_tolerance, 0, 1)
    assert isinstance(pg, ProcessGroupGloo)
    assert pg._heal_interfaces == pinned
