"""Manager unit tests.

The step's pure decisions are tested in ``test_decisions.py``. The Manager runs against a
real in-process lighthouse and ManagerServer (cheap, and the quorum protocol is the point);
only the cross-group process group and the checkpoint transport are fakes here, since their
real implementations are tested in their own modules and across processes in
``test_manager_integration.py``.
"""

from __future__ import annotations

import copy
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed import ReduceOp

from torchtitan_ft import timeouts
from torchtitan_ft.events import EVENTS_DIR_ENV, EventKind, read_events
from torchtitan_ft.lighthouse import LighthouseServer
from torchtitan_ft.lighthouse.exclusion import Exclusion, ExclusionOptions, StragglerPolicy
from torchtitan_ft.manager import (
    AddressInUseError,
    Manager,
    ManagerOptions,
    ManagerStats,
    ReplicaGroupMismatchError,
    WorldSizeMode,
    model_fingerprint,
)
from torchtitan_ft.process_group import GroupConfig

# ------------------------------------------------------------------------------ fakes

_QUIET = (EventKind.START, EventKind.QUORUM)
"""Event kinds a test of faults and commits skips."""


class _Work:
    def __init__(self, fut: torch.futures.Future[Any]) -> None:
        self._fut = fut

    def get_future(self) -> torch.futures.Future[Any]:
        return self._fut


class FakePG:
    """Records configure calls; allreduce completes at once with the input (a 1-member sum),
    or fails / never completes on demand."""

    def __init__(self) -> None:
        self.configures: list[GroupConfig] = []
        self.mode = "ok"  # "ok" | "raise" | "fail_future" | "hang"
        self.error: Exception | None = None
        self.seen: list[torch.Tensor] = []
        self.aborts = 0

    def abort(self) -> None:
        self.aborts += 1

    def configure(self, **kwargs: Any) -> None:
        """Records the call; the Manager passes keywords (``ProcessGroup.configure``'s)."""
        if self.mode == "configure_fails":
            raise RuntimeError("configure failed")
        self.configures.append(GroupConfig(**kwargs))

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> _Work:
        self.seen.append(tensors[0].clone())
        if self.mode == "raise":
            raise RuntimeError("pg broken")
        fut: torch.futures.Future[Any] = torch.futures.Future()
        if self.mode == "fail_future":
            fut.set_exception(RuntimeError("peer reset"))
        elif self.mode == "ok":
            fut.set_result(tensors)
        return _Work(fut)

    def errored(self) -> Exception | None:
        return self.error


class MemoryTransport:
    """Checkpoint transport through a process-wide dict, deep-copying like a wire would."""

    _offers: dict[tuple[str, int], Any] = {}

    def __init__(self) -> None:
        self._id = str(uuid.uuid4())
        self.fail_recv = False
        self.disallowed = 0

    def metadata(self) -> str:
        return self._id

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: Any, timeout: Any
    ) -> None:
        self._offers[(self._id, step)] = copy.deepcopy(state_dict)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: Any) -> Any:
        if self.fail_recv:
            raise RuntimeError("source went away mid-transfer")
        # Waits for the donor's offer, as a real transport does: the donor's quorum thread may
        # offer after the healer asks (a bare lookup raised KeyError once under load).
        deadline = time.monotonic() + 10
        while (metadata, step) not in self._offers and time.monotonic() < deadline:
            time.sleep(0.01)
        return copy.deepcopy(self._offers[(metadata, step)])

    def disallow_checkpoint(self) -> None:
        self.disallowed += 1

    def shutdown(self, wait: bool = True) -> None:
        pass


class UserState:
    """A stand-in for model + optimizer state; records when it is loaded."""

    def __init__(self, value: float) -> None:
        self.weights = torch.full((4,), value)
        self.loads: list[str] = []
        self.phase = "idle"

    def state_dict(self) -> dict[str, Any]:
        return {"weights": self.weights}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.loads.append(self.phase)
        self.weights = sd["weights"].clone()


@pytest.fixture
def lighthouse() -> Iterator[LighthouseServer]:
    server = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=200, heartbeat_timeout_ms=2000
    )
    yield server
    server.shutdown()


def _manager(
    lighthouse: LighthouseServer,
    replica: str,
    user: UserState | None = None,
    pg: FakePG | None = None,
    transport: MemoryTransport | None = None,
    **kwargs: Any,
) -> Manager:
    user = user or UserState(0.0)
    return Manager(
        pg=pg or FakePG(),
        load_state_dict=user.load_state_dict,
        state_dict=user.state_dict,
        min_replica_size=kwargs.pop("min_replica_size", 1),
        lighthouse_addr=lighthouse.address(),
        replica_id=replica,
        rank=0,
        world_size=1,
        hostname="127.0.0.1",
        checkpoint_transport=transport or MemoryTransport(),
        timeout=kwargs.pop("timeout", timedelta(seconds=10)),
        quorum_timeout=kwargs.pop("quorum_timeout", timedelta(seconds=10)),
        connect_timeout=kwargs.pop("connect_timeout", timedelta(seconds=10)),
        **kwargs,
    )


# ------------------------------------------------------------------------------ one replica


def test_commit_advances_step_and_batches(lighthouse: LighthouseServer, tmp_path: Path) -> None:
    pg = FakePG()
    manager = _manager(lighthouse, "solo", pg=pg, events_dir=tmp_path)
    try:
        assert manager.participating_rank() is None and manager.num_participants() == 0
        for step in range(3):
            manager.start_quorum()
            tensor = torch.tensor([2.0, 4.0])
            assert manager.allreduce(tensor).wait() is tensor
            assert torch.equal(tensor, torch.tensor([2.0, 4.0]))  # sum of 1 / 1 participant
            assert manager.should_commit()
            assert manager.current_step() == step + 1
        assert manager.batches_committed() == 3
        assert manager.participating_rank() == 0 and manager.is_participating()
        assert len(pg.configures) == 1  # same quorum id: no reconfiguration
        config = pg.configures[0]
        assert config.store_addr.endswith(f"/torchft/{config.quorum_id}/0")
        assert config.replica_id.startswith("solo:")
        assert (config.rank, config.world_size) == (0, 1)
        assert (config.group_rank, config.group_world_size, config.global_ranks) == (0, 1, [0])
        assert manager.state_dict() == {"step": 3, "batches_committed": 3}
        # the event stream: start, one quorum (its id never changed), three commits
        events = read_events(tmp_path)
        kinds = [e.kind for e in events]
        assert kinds == [EventKind.START, EventKind.QUORUM, *[EventKind.COMMIT] * 3]
        assert {e.replica_id for e in events} == {manager.replica_id}
        assert events[0]["pid"] == os.getpid()
        assert events[1]["role"] == "participant" and events[1]["participants"] == 1
        assert events[1]["replica_ids"] == [manager.replica_id]
        assert [(e.step, e["participants"]) for e in events[2:]] == [(1, 1), (2, 1), (3, 1)]
    finally:
        manager.shutdown()


def test_timeouts_far_above_the_step_are_reported_once(
    lighthouse: LighthouseServer, tmp_path: Path
) -> None:
    """Steps of milliseconds, timeouts of 700 s (> 10x the step and > 600 s): one
    ``oversized_timeout`` event each, after the first steps; none again later."""
    long = timedelta(seconds=700)
    manager = _manager(
        lighthouse, "slow", events_dir=tmp_path, timeout=long, quorum_timeout=long,
        connect_timeout=timedelta(seconds=30),
    )  # fmt: skip
    try:
        for _ in range(2 + timeouts.OVERSIZE_STEPS + 3):
            manager.start_quorum()
            manager.allreduce(torch.ones(2)).wait()
            assert manager.should_commit()
        found = [e for e in read_events(tmp_path) if e.kind is EventKind.OVERSIZED_TIMEOUT]
        assert [(e["timeout"], e["seconds"]) for e in found] == [
            ("step_timeout_ms", 700.0),
            ("quorum_timeout_ms", 700.0),
        ]
        assert all(0 < e["step_seconds"] < 70 for e in found)
        # judged at the first step after the first OVERSIZE_STEPS measured ones
        assert {e.step for e in found} == {1 + timeouts.OVERSIZE_STEPS}
    finally:
        manager.shutdown()


def test_the_lighthouse_counts_committed_samples_when_the_trainer_says_its_batch(
    lighthouse: LighthouseServer,
) -> None:
    # The Manager's own options as one ManagerOptions (elsewhere: as keywords, the same).
    manager = _manager(lighthouse, "samples", options=ManagerOptions(samples_per_batch=8))
    try:

        def job() -> dict:
            return lighthouse.run_in_loop(lambda: lighthouse.state.status()["job"])

        for _ in range(3):  # a step reports what committed before it: 0, 1, 2 batches
            manager.start_quorum()
            assert manager.should_commit()
        assert (job()["unit"], job()["samples_committed"], job()["batches_committed"]) == (
            "samples",
            16,
            2,
        )
        manager.set_samples_per_batch(4)  # e.g. TorchTitan's trainer, once it knows its batch
        manager.start_quorum()
        assert manager.should_commit()
        assert job()["samples_committed"] == 12
        for bad in (0, True, 2.5):
            with pytest.raises(ValueError, match="samples_per_batch must be"):
                manager.set_samples_per_batch(bad)
    finally:
        manager.shutdown()


def test_errors_are_data(
    lighthouse: LighthouseServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pg = FakePG()
    transport = MemoryTransport()
    monkeypatch.setenv(EVENTS_DIR_ENV, str(tmp_path))  # the env var, when no argument
    manager = _manager(lighthouse, "err", pg=pg, transport=transport)
    try:
        # a collective whose future fails: completed future with the input, step discarded
        manager.start_quorum()
        pg.mode = "fail_future"
        tensor = torch.ones(2)
        assert manager.allreduce(tensor).wait() is tensor
        assert "peer reset" in str(manager.errored())
        # later collectives of the step are no-ops; a participant aborts the group instead of
        # joining, so its peers fail at once rather than wait for it until the timeout
        calls = len(pg.seen)
        manager.allreduce(torch.ones(2)).wait()
        assert len(pg.seen) == calls
        assert pg.aborts == 1
        assert not manager.should_commit()
        assert manager.current_step() == 0 and transport.disallowed == 1

        # a collective that raises at launch
        manager.start_quorum()
        assert manager.errored() is None  # cleared by the new quorum
        pg.mode = "raise"
        manager.allreduce(torch.ones(2)).wait()
        assert not manager.should_commit()

        # a process group reporting an error of its own
        manager.start_quorum()
        pg.mode, pg.error = "ok", RuntimeError("gloo aborted")
        assert not manager.should_commit()
        pg.error = None

        # a future that never completes times out into an error
        manager.start_quorum()
        never: torch.futures.Future[str] = torch.futures.Future()
        assert (
            manager.wrap_future(never, "dflt", timeout=timedelta(milliseconds=50)).wait() == "dflt"
        )
        assert isinstance(manager.errored().original_exception, TimeoutError)  # type: ignore[union-attr]
        assert not manager.should_commit()

        # and then the next clean step commits
        manager.start_quorum()
        manager.allreduce(torch.ones(2)).wait()
        assert manager.should_commit() and manager.current_step() == 1
        # each failed step: one fault (its first error) and a discard; then the commit
        events = [e for e in read_events(tmp_path) if e.kind not in _QUIET]
        faults = [e for e in events if e.kind is EventKind.FAULT]
        assert [e["error"] for e in faults] == ["RuntimeError"] * 3 + ["TimeoutError"]
        assert "peer reset" in faults[0]["message"]
        discards = [e for e in events if e.kind is EventKind.DISCARD]
        assert len(discards) == 4 and all(e.step == 0 for e in discards)
        assert all("error" in e["reason"] for e in discards), discards
        assert events[-1].kind is EventKind.COMMIT and events[-1].step == 1
    finally:
        manager.shutdown()


def test_failed_configure_discards_step(lighthouse: LighthouseServer) -> None:
    pg = FakePG()
    pg.mode = "configure_fails"
    manager = _manager(lighthouse, "cfg", pg=pg)
    try:
        manager.start_quorum()
        tensor = torch.ones(2)
        manager.allreduce(tensor).wait()
        assert pg.seen == []  # no collective on an unconfigured group
        assert not manager.should_commit()
        pg.mode = "ok"
        manager.start_quorum()  # commit_failures > 0 -> new quorum id -> configure again
        manager.allreduce(tensor).wait()
        assert manager.should_commit()
    finally:
        manager.shutdown()


def test_max_retries(lighthouse: LighthouseServer) -> None:
    manager = _manager(lighthouse, "retry", max_retries=1)
    try:
        manager.start_quorum()
        manager.report_error(RuntimeError("bad step"))
        assert not manager.should_commit()
        manager.start_quorum()
        manager.report_error(RuntimeError("bad step"))
        with pytest.raises(RuntimeError, match="2 times in a row, exceeding max_retries=1"):
            manager.should_commit()
    finally:
        manager.shutdown()


def test_not_enough_replicas_votes_no(lighthouse: LighthouseServer) -> None:
    manager = _manager(lighthouse, "lonely", min_replica_size=2)
    try:
        manager.start_quorum()
        assert manager.num_participants() == 1
        assert not manager.should_commit()
        assert manager.current_step() == 0
    finally:
        manager.shutdown()


def test_api_misuse_raises_clear_errors(lighthouse: LighthouseServer) -> None:
    with pytest.raises(ValueError, match="min_replica_size must be >= 1"):
        _manager(lighthouse, "x", min_replica_size=0)
    with pytest.raises(ValueError, match="retry_inflight_allreduce must be a bool, got 'yes'"):
        _manager(lighthouse, "x", retry_inflight_allreduce="yes")
    with pytest.raises(ValueError, match="retry_inflight_allreduce=True needs use_async_quorum"):
        _manager(lighthouse, "x", retry_inflight_allreduce=True, use_async_quorum=False)
    manager = _manager(lighthouse, "misuse")
    try:
        with pytest.raises(RuntimeError, match="before start_quorum"):
            manager.wait_quorum()
        with pytest.raises(RuntimeError, match="before start_quorum"):
            manager.should_commit()
        manager.start_quorum()
        with pytest.raises(TypeError, match="floating point"):
            manager.allreduce(torch.ones(2, dtype=torch.int64))
        with pytest.raises(ValueError, match="already registered"):
            manager.register_state_dict_fn("default", lambda s: None, dict)
        assert manager.should_commit()
    finally:
        manager.shutdown()


def test_retry_inflight_without_wait_abandoned_is_a_warning_at_construction(
    lighthouse: LighthouseServer, caplog: pytest.LogCaptureFixture
) -> None:
    from torchtitan_ft.process_group import ErrorSwallowingProcessGroupWrapper, ProcessGroupGloo

    def warnings_of(pg: Any, name: str) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="torchtitan_ft.manager.manager"):
            manager = _manager(lighthouse, name, pg=pg, retry_inflight_allreduce=True)
        try:
            return [r.getMessage() for r in caplog.records if "retry_inflight" in r.getMessage()]
        finally:
            manager.shutdown()

    (line,) = warnings_of(FakePG(), "cannot_retry")
    assert "has no effect" in line and "can_wait_abandoned() is False" in line
    # A wrapped gloo group forwards the capability: no warning, and the retry is possible.
    wrapped = ErrorSwallowingProcessGroupWrapper(ProcessGroupGloo(timedelta(seconds=5)))
    assert warnings_of(wrapped, "can_retry") == []


def test_explicit_args_beat_env(lighthouse: LighthouseServer, monkeypatch: Any) -> None:
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://127.0.0.1:1")  # nothing listens there
    monkeypatch.setenv("REPLICA_GROUP_ID", "from_env")
    monkeypatch.setenv("RANK", "5")
    manager = _manager(lighthouse, "from_arg")
    try:
        assert manager.replica_id.startswith("from_arg:")
        assert manager.settings.lighthouse_addr.value == lighthouse.address()
        manager.start_quorum()
        assert manager.should_commit()
    finally:
        manager.shutdown()


def test_quorum_timeout_when_lighthouse_down() -> None:
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    address = server.address()
    server.shutdown()
    manager = Manager(
        pg=FakePG(),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=1,
        lighthouse_addr=address,
        replica_id="orphan",
        rank=0,
        world_size=1,
        hostname="127.0.0.1",
        checkpoint_transport=MemoryTransport(),
        quorum_timeout=timedelta(seconds=1),
        connect_timeout=timedelta(seconds=1),
        timeout=timedelta(seconds=1),
    )
    try:
        start = time.monotonic()
        manager.start_quorum()
        tensor = torch.ones(2)
        # the collective does not raise through the caller: it records the failure ...
        assert manager.allreduce(tensor).wait() is tensor
        assert manager.errored() is not None
        # ... and should_commit / wait_quorum surface it, bounded by quorum_timeout
        with pytest.raises(TimeoutError):
            manager.should_commit()
        assert time.monotonic() - start < 5
    finally:
        manager.shutdown()


def test_torchft_timeout_env_vars_apply_when_not_passed(
    monkeypatch: Any, caplog: pytest.LogCaptureFixture
) -> None:
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    address = server.address()
    server.shutdown()
    # With the defaults (60 s) the failed quorum below would take a minute.
    monkeypatch.setenv("TORCHFT_QUORUM_TIMEOUT_SEC", "1")
    monkeypatch.setenv("TORCHFT_CONNECT_TIMEOUT_SEC", "1")
    monkeypatch.setenv("TORCHFT_TIMEOUT_SEC", "1")
    monkeypatch.setenv("TORCHFT_QUORUM_RETRIES", "2")
    with caplog.at_level(logging.INFO, logger="torchtitan_ft.manager.manager"):
        manager = Manager(
            pg=FakePG(),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=1,
            lighthouse_addr=address,
            replica_id="orphan_env",
            rank=0,
            world_size=1,
            hostname="127.0.0.1",
            checkpoint_transport=MemoryTransport(),
        )
    try:
        settings = manager.settings
        assert settings.quorum_timeout.env_var == "TORCHFT_QUORUM_TIMEOUT_SEC"
        assert settings.quorum_retries.value == 2
        lines = [r.getMessage() for r in caplog.records if "settings:" in r.getMessage()]
        assert len(lines) == 1, lines  # resolved values logged once, with their sources
        assert "(env TORCHFT_QUORUM_TIMEOUT_SEC)" in lines[0]
        start = time.monotonic()
        manager.start_quorum()
        with pytest.raises(TimeoutError):
            manager.should_commit()
        assert time.monotonic() - start < 10
    finally:
        manager.shutdown()


# ------------------------------------------------------------------------------ two replicas


def _vote_in_parallel(managers: list[Manager]) -> list[bool]:
    """Every manager's ``should_commit`` at once (a barrier within each replica group)."""
    votes: list[bool] = []
    voters = [
        threading.Thread(target=lambda m=m: votes.append(m.should_commit())) for m in managers
    ]
    for t in voters:
        t.start()
    for t in voters:
        t.join(timeout=30)
    return votes


def _step_both(managers: list[Manager], tensors: list[torch.Tensor] | None = None) -> list[bool]:
    for m in managers:
        m.start_quorum()
    if tensors is not None:
        for m, t in zip(managers, tensors, strict=True):
            m.allreduce(t).wait()
    return [m.should_commit() for m in managers]


@pytest.fixture
def lighthouse2() -> Iterator[LighthouseServer]:
    server = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=2, join_timeout_ms=5000, heartbeat_timeout_ms=2000
    )
    yield server
    server.shutdown()


def test_behind_replica_heals_at_safe_point(lighthouse2: LighthouseServer) -> None:
    donor_user, healer_user = UserState(7.0), UserState(-1.0)
    donor = _manager(lighthouse2, "a_donor", user=donor_user, init_sync=False)
    healer_pg = FakePG()
    healer = _manager(lighthouse2, "b_healer", user=healer_user, pg=healer_pg, init_sync=False)
    try:
        donor.load_state_dict({"step": 3, "batches_committed": 6})
        donor.start_quorum()
        healer.start_quorum()
        healer_user.phase = "forward"
        healer.wait_quorum()  # transfer done, but nothing applied yet
        assert healer_user.loads == [] and torch.equal(healer_user.weights, torch.full((4,), -1.0))
        assert not healer.is_participating() and healer.num_participants() == 1
        grad = torch.full((2,), 5.0)
        healer.allreduce(grad).wait()
        assert torch.equal(healer_pg.seen[-1], torch.zeros(2))  # non-participant sends zeros
        donor.allreduce(torch.ones(2)).wait()
        healer_user.phase = "should_commit"
        assert healer.should_commit() and donor.should_commit()
        assert healer_user.loads == ["should_commit"]
        assert torch.equal(healer_user.weights, donor_user.weights)
        assert healer.current_step() == donor.current_step() == 4
        assert healer.batches_committed() == donor.batches_committed() == 7
        # the heal in the stats: the state moved is the donor's 4 fp32 weights
        healed, served = healer.stats(), donor.stats()
        assert (healed.heal_count, healed.heal_bytes_received, healed.heal_bytes_sent) == (1, 16, 0)
        assert healed.last_heal_seconds == healed.heal_seconds > 0
        assert (served.heal_count, served.heal_bytes_received, served.heal_bytes_sent) == (0, 0, 16)
        assert not healed.participating and healed.num_participants == 1
        assert healed.replica_world_size == served.replica_world_size == 2
        # next step: both up to date, both participate
        assert _step_both([donor, healer]) == [True, True]
        assert healer.is_participating() and healer.num_participants() == 2
        # the heal and the committed batches reached the lighthouse with that step's request
        views = lighthouse2.run_in_loop(lambda: lighthouse2.state.status()["groups"])
        heals = {v["replica_id"].split(":")[0]: v["heals"] for v in views}
        assert [(h["to_step"], h["bytes"], h["outcome"]) for h in heals["b_healer"]] == [
            (3, 16, "applied")
        ]
        assert heals["a_donor"] == []
        assert {v["batches_committed"] for v in views} == {7}
    finally:
        donor.shutdown()
        healer.shutdown()


def test_failed_heal_is_retried_and_nothing_applied(
    lighthouse2: LighthouseServer, tmp_path: Path
) -> None:
    healer_user = UserState(-1.0)
    transport = MemoryTransport()
    transport.fail_recv = True
    donor = _manager(lighthouse2, "a_donor", user=UserState(3.0), init_sync=False)
    healer = _manager(
        lighthouse2,
        "b_healer",
        user=healer_user,
        transport=transport,
        init_sync=False,
        events_dir=tmp_path,
    )
    try:
        donor.load_state_dict({"step": 2, "batches_committed": 2})
        assert _step_both([donor, healer]) == [True, False]
        assert healer_user.loads == [] and healer.current_step() == 0
        assert "mid-transfer" in str(healer.errored())
        transport.fail_recv = False
        assert _step_both([donor, healer]) == [True, True]
        assert healer_user.loads == ["idle"]
        assert healer.current_step() == donor.current_step() == 4
        assert torch.equal(healer_user.weights, torch.full((4,), 3.0))
        # the healer's stream: a failed heal, then one that applied 16 bytes (4 fp32)
        heals = [
            e for e in read_events(tmp_path) if e.kind in (EventKind.HEAL_START, EventKind.HEAL_END)
        ]
        assert [(e.kind, e.get("outcome")) for e in heals] == [
            (EventKind.HEAL_START, None),
            (EventKind.HEAL_END, "failed"),
            (EventKind.HEAL_START, None),
            (EventKind.HEAL_END, "applied"),
        ]
        assert heals[0]["to_step"] == 2 and heals[0]["source_replica_rank"] == 0
        assert "mid-transfer" in heals[1]["error"] and heals[1]["bytes"] == 0
        assert heals[3]["bytes"] == 16 and heals[3]["seconds"] > 0 and heals[3].step == 3
        roles = [e["role"] for e in read_events(tmp_path) if e.kind is EventKind.QUORUM]
        assert roles[0] == "healing"
    finally:
        donor.shutdown()
        healer.shutdown()


def test_sync_quorum_heals_before_forward(lighthouse2: LighthouseServer) -> None:
    healer_user = UserState(-1.0)
    donor = _manager(lighthouse2, "a", user=UserState(2.0), use_async_quorum=False)
    healer = _manager(lighthouse2, "b", user=healer_user, use_async_quorum=False)
    try:
        # two sync managers in one thread: start the donor's quorum concurrently
        thread = threading.Thread(target=donor.start_quorum)
        thread.start()
        healer.start_quorum()  # init_sync: step 0, non-primary heals, applied right here
        thread.join()
        assert len(healer_user.loads) == 1
        assert torch.equal(healer_user.weights, torch.full((4,), 2.0))
        assert healer.is_participating() and healer.num_participants() == 2
        assert healer.should_commit() and donor.should_commit()
    finally:
        donor.shutdown()
        healer.shutdown()


def test_fixed_with_spares(lighthouse2: LighthouseServer, tmp_path: Path) -> None:
    pgs = [FakePG(), FakePG()]
    managers = [
        _manager(
            lighthouse2,
            name,
            pg=pg,
            init_sync=False,
            world_size_mode=WorldSizeMode.FIXED_WITH_SPARES,
            events_dir=tmp_path,
        )
        for name, pg in zip(["a", "b"], pgs, strict=True)
    ]
    try:
        tensors = [torch.full((2,), 4.0), torch.full((2,), 6.0)]
        assert _step_both(managers, tensors) == [True, True]
        assert [m.participating_rank() for m in managers] == [0, None]
        assert [m.num_participants() for m in managers] == [1, 1]
        assert torch.equal(pgs[0].seen[-1], torch.full((2,), 4.0))
        assert torch.equal(pgs[1].seen[-1], torch.zeros(2))  # the spare contributes zeros
        assert [m.batches_committed() for m in managers] == [1, 1]
        # one folder, one file per manager; the quorum events name each one's role
        quorums = [e for e in read_events(tmp_path) if e.kind is EventKind.QUORUM]
        roles = {e.replica_name: e["role"] for e in quorums}
        assert roles == {"a": "participant", "b": "spare"}
        assert all(e["participants"] == 1 and len(e["replica_ids"]) == 2 for e in quorums)
        assert len(list(tmp_path.glob("*.jsonl"))) == 2
    finally:
        for m in managers:
            m.shutdown()


def test_errored_spare_still_joins_with_zeros(lighthouse2: LighthouseServer) -> None:
    """A non-participant's zeros do not change the average: it joins even after an error, so
    the participants' collective completes, and only its own group discards the step."""
    pgs = [FakePG(), FakePG()]
    managers = [
        _manager(lighthouse2, name, pg=pg, init_sync=False,
                 world_size_mode=WorldSizeMode.FIXED_WITH_SPARES)
        for name, pg in zip(["a", "b"], pgs, strict=True)
    ]  # fmt: skip
    try:
        for m in managers:
            m.start_quorum()
        managers[1].report_error(RuntimeError("bad batch on the spare"))
        for m, value in zip(managers, [4.0, 6.0], strict=True):
            m.allreduce(torch.full((2,), value)).wait()
        assert torch.equal(pgs[1].seen[-1], torch.zeros(2))
        assert [pg.aborts for pg in pgs] == [0, 0]
        votes = _vote_in_parallel(managers)
        assert sorted(votes) == [False, True]
    finally:
        for m in managers:
            m.shutdown()


def test_quantized_allreduce_through_real_process_groups(lighthouse2: LighthouseServer) -> None:
    """should_quantize: int8 blocks over real gloo groups; replicas agree bit for bit, the
    average is within the quantization bound and a quarter of the fp32 bytes is sent."""
    from torchtitan_ft.process_group import ProcessGroupGloo

    class CountingGloo(ProcessGroupGloo):
        """Adds up the bytes its collectives send to the other rank of two."""

        sent = 0

        def alltoall_base(self, output: Any, input: torch.Tensor, *args: Any) -> Any:
            self.sent += input.numel() * input.element_size() // 2  # the other rank's half
            return super().alltoall_base(output, input, *args)

        def allgather(self, outputs: Any, inputs: list[torch.Tensor], *args: Any) -> Any:
            self.sent += sum(t.numel() * t.element_size() for t in inputs)  # one copy
            return super().allgather(outputs, inputs, *args)

    pgs = [CountingGloo(timedelta(seconds=10)) for _ in range(2)]
    managers = [_manager(lighthouse2, f"q{i}", pg=pgs[i], init_sync=False) for i in range(2)]
    torch.manual_seed(0)
    inputs = [torch.randn(4096) for _ in managers]
    tensors = [t.clone() for t in inputs]
    try:
        for m in managers:
            m.start_quorum()
        threads = [
            threading.Thread(target=lambda m=m, t=t: m.allreduce(t, should_quantize=True).wait())
            for m, t in zip(managers, tensors, strict=True)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert [m.errored() for m in managers] == [None, None]
        votes = _vote_in_parallel(managers)
        assert votes == [True, True]
    finally:
        for m in managers:
            m.shutdown()
    assert torch.equal(tensors[0], tensors[1])
    assert [m.stats().allreduce_bytes for m in managers] == [4096 * 4] * 2  # payload, not wire
    expected = (inputs[0] + inputs[1]) / 2
    # Two int8 roundings (before and after the reduction), each within half a step of a block
    # whose scale is at most max|x| / 127.
    bound = 2 * max(float(inputs[0].abs().max()), float(inputs[1].abs().max())) / 127
    assert float((tensors[0] - expected).abs().max()) <= bound
    fp32_ring_bytes = 2 * 4096 * 4 * (2 - 1) / 2  # per replica, ring allreduce of fp32
    sent = pgs[0].sent
    assert 0.2 < sent / fp32_ring_bytes < 0.35


# ------------------------------------------------------------------------------ stats


def test_stats_count_allreduce_bytes_and_discarded_steps(lighthouse: LighthouseServer) -> None:
    pg = FakePG()
    manager = _manager(lighthouse, "stats", pg=pg)
    try:
        before = manager.stats()
        assert before == ManagerStats(
            step=0, quorum_id=-1, replica_world_size=0, num_participants=0,
            participating=False, commit_failures=0, steps_discarded=0, heal_count=0,
            last_heal_seconds=0.0, heal_seconds=0.0, heal_bytes_received=0,
            heal_bytes_sent=0, allreduce_bytes=0,
        )  # fmt: skip
        manager.start_quorum()
        manager.allreduce(torch.ones(10)).wait()
        manager.allreduce(torch.ones(3, dtype=torch.float64), reduce_op=ReduceOp.SUM).wait()
        assert manager.should_commit()
        manager.start_quorum()
        manager.report_error(RuntimeError("bad batch"))
        manager.allreduce(torch.ones(10)).wait()  # not sent: the step already failed
        assert not manager.should_commit()
        stats = manager.stats()
        assert stats.allreduce_bytes == 10 * 4 + 3 * 8
        assert (stats.step, stats.commit_failures, stats.steps_discarded) == (1, 1, 1)
        assert stats.quorum_id == pg.configures[-1].quorum_id
        assert (stats.replica_world_size, stats.num_participants) == (1, 1)
        assert stats.participating and stats.heal_count == 0
    finally:
        manager.shutdown()


def test_stats_never_waits_for_the_quorum(lighthouse2: LighthouseServer) -> None:
    manager = _manager(lighthouse2, "waiting")  # min_replicas=2: the quorum cannot form
    try:
        manager.start_quorum()
        started = time.monotonic()
        assert manager.stats().quorum_id == -1
        assert time.monotonic() - started < 0.1
    finally:
        manager.shutdown(wait=False)


# ------------------------------------------------------------------------------ init_sync


def _allreduce_in_parallel(managers: list[Manager], tensors: list[torch.Tensor]) -> None:
    threads = [
        threading.Thread(target=lambda m=m, t=t: m.allreduce(t).wait())
        for m, t in zip(managers, tensors, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)


@pytest.mark.parametrize("min_replica_size", [1, 2])
def test_step_zero_init_sync_averages_only_the_primary_gradient(
    lighthouse2: LighthouseServer, min_replica_size: int
) -> None:
    """At step 0 with init_sync the non-primary group heals from the primary and sends zeros:
    the average is the primary's own gradient (not half of it), and the step commits even
    with min_replica_size=2, since both groups end it with the primary's state."""
    from torchtitan_ft.process_group import ProcessGroupGloo

    users = [UserState(1.0), UserState(-1.0)]
    managers = [
        _manager(
            lighthouse2,
            name,
            user=user,
            pg=ProcessGroupGloo(timedelta(seconds=10)),
            min_replica_size=min_replica_size,
        )
        for name, user in zip(["a_primary", "b_healer"], users, strict=True)
    ]
    try:
        for m in managers:
            m.start_quorum()
        grads = [torch.full((3,), 6.0), torch.full((3,), 2.0)]
        _allreduce_in_parallel(managers, grads)
        assert [m.num_participants() for m in managers] == [1, 1]
        assert [m.is_participating() for m in managers] == [True, False]
        assert torch.equal(grads[0], torch.full((3,), 6.0))  # the primary's own gradient
        assert torch.equal(grads[1], torch.full((3,), 6.0))
        assert _vote_in_parallel(managers) == [True, True]
        assert torch.equal(users[1].weights, users[0].weights)  # healed from the primary
        assert [m.batches_committed() for m in managers] == [1, 1]
        # the next step: both contribute, the average of both
        for m in managers:
            m.start_quorum()
        grads = [torch.full((3,), 6.0), torch.full((3,), 2.0)]
        _allreduce_in_parallel(managers, grads)
        assert [m.num_participants() for m in managers] == [2, 2]
        assert torch.equal(grads[0], torch.full((3,), 4.0))
        assert _vote_in_parallel(managers) == [True, True]
    finally:
        for m in managers:
            m.shutdown()


def test_mid_run_heal_averages_only_the_up_to_date_gradient(
    lighthouse2: LighthouseServer,
) -> None:
    from torchtitan_ft.process_group import ProcessGroupGloo

    managers = [
        _manager(lighthouse2, name, user=UserState(v), pg=ProcessGroupGloo(timedelta(seconds=10)))
        for name, v in [("a_donor", 1.0), ("b_joiner", -1.0)]
    ]
    try:
        managers[0].load_state_dict({"step": 5, "batches_committed": 5})
        for m in managers:
            m.start_quorum()
        grads = [torch.full((3,), 6.0), torch.full((3,), 2.0)]
        _allreduce_in_parallel(managers, grads)
        assert [m.num_participants() for m in managers] == [1, 1]
        assert torch.equal(grads[0], torch.full((3,), 6.0))
        assert torch.equal(grads[1], torch.full((3,), 6.0))
        assert _vote_in_parallel(managers) == [True, True]
        assert [m.current_step() for m in managers] == [6, 6]
    finally:
        for m in managers:
            m.shutdown()


# ------------------------------------------------------------------------------ identity


def test_fingerprint_function_runs_once_and_mismatch_fails_newcomer(
    lighthouse: LighthouseServer,
) -> None:
    calls: list[str] = []

    def fingerprint(width: int) -> Any:
        def compute() -> str:
            calls.append(f"w{width}")
            with torch.device("meta"):
                return model_fingerprint(torch.nn.Linear(8, width))

        return compute

    running = _manager(lighthouse, "ft_0", model_fingerprint=fingerprint(4), num_replica_groups=2)
    newcomer = None
    try:
        for _ in range(2):
            running.start_quorum()
            assert running.should_commit()
        assert calls == ["w4"]
        newcomer = _manager(
            lighthouse, "ft_1", model_fingerprint=fingerprint(5), num_replica_groups=2
        )
        newcomer.start_quorum()
        time.sleep(0.3)  # the newcomer waits for the running group, a previous member
        running.start_quorum()
        with pytest.raises(ReplicaGroupMismatchError, match="'ft_1' runs a different model"):
            newcomer.should_commit()
        running.wait_quorum()  # the running group got its quorum
        assert calls == ["w4", "w5"]
    finally:
        running.shutdown(wait=False)
        if newcomer is not None:
            newcomer.shutdown(wait=False)


# ------------------------------------------------------------------------------ port in use


@pytest.mark.parametrize("from_env", [False, True])
def test_manager_port_in_use_is_one_clear_line(
    lighthouse: LighthouseServer, monkeypatch: Any, from_env: bool
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        if from_env:
            monkeypatch.setenv("TORCHFT_MANAGER_PORT", str(port))
        with pytest.raises(AddressInUseError) as excinfo:
            _manager(lighthouse, "busy", **({} if from_env else {"port": port}))
    message = str(excinfo.value)
    origin = f"TORCHFT_MANAGER_PORT={port}" if from_env else f"port={port} argument"
    assert f"manager server port {port} (from " in message and origin in message
    assert "already in use" in message and "choose a free port" in message
    assert "\n" not in message and excinfo.value.__suppress_context__


def test_excluded_group_runs_alone_commits_nothing_and_heals_when_taken_back(
    tmp_path: Path,
) -> None:
    """The lighthouse's straggler policy leaves group b out (set on its state: the judge's
    side is tested in tests/lighthouse): b's steps run without a cross-group collective and
    are discarded without counting as commit failures while a commits alone; taken back, b
    heals from a and both commit together."""
    server = LighthouseServer(
        bind="127.0.0.1:0",
        min_replicas=1,
        join_timeout_ms=5000,
        heartbeat_timeout_ms=2000,
        exclusion=ExclusionOptions(StragglerPolicy.EXCLUDE, min_excluded_s=30.0),
    )
    a_user, b_user = UserState(7.0), UserState(-1.0)
    # A quorum may wait out the join timeout (5 s): 30 s leaves room for a loaded machine.
    slack = {"timeout": timedelta(seconds=30), "quorum_timeout": timedelta(seconds=30)}
    a = _manager(server, "a", user=a_user, init_sync=False, events_dir=tmp_path, **slack)
    b_pg = FakePG()
    b = _manager(
        server,
        "b",
        user=b_user,
        pg=b_pg,
        transport=MemoryTransport(),
        init_sync=False,
        events_dir=tmp_path,
        **slack,
    )

    def leave_b_out(since: float) -> None:
        state = server.state
        server.run_in_loop(
            lambda: state.exclusions.__setitem__(b.replica_id, Exclusion(since, (since,)))
        )

    try:
        a.load_state_dict({"step": 2, "batches_committed": 2})
        b.load_state_dict({"step": 2, "batches_committed": 2})
        assert _step_both([a, b], [torch.ones(2), torch.ones(2)]) == [True, True]
        leave_b_out(time.monotonic())
        for _ in range(2):
            b.start_quorum()
            grad = torch.full((2,), 5.0)
            seen = len(b_pg.seen)
            assert b.allreduce(grad).wait() is grad and torch.equal(grad, torch.full((2,), 5.0))
            assert len(b_pg.seen) == seen  # no cross-group collective
            assert not b.should_commit()
            assert b.stats().excluded and b.stats().commit_failures == 0
            a.start_quorum()
            a.allreduce(torch.ones(2)).wait()
            assert a.should_commit() and a.num_participants() == 1
        assert b.current_step() == 3 and a.current_step() == 5
        leave_b_out(time.monotonic() - 60)  # out long enough, not a straggler: taken back
        b.start_quorum()
        deadline = time.monotonic() + 10
        # b waits in the lighthouse's round before a asks (else a's quorum is a alone again,
        # and b joins at a's next step, which this test does not take).
        while b.replica_id not in server.run_in_loop(lambda: set(server.state.pending)):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        a.start_quorum()
        for m in (a, b):
            m.allreduce(torch.ones(2)).wait()
        assert [b.should_commit(), a.should_commit()] == [True, True]
        assert torch.equal(b_user.weights, a_user.weights)
        assert b.current_step() == a.current_step() == 6 and not b.stats().excluded
        kinds = [e.kind for e in read_events(tmp_path) if e.replica_id == b.replica_id]
        out = kinds[kinds.index(EventKind.EXCLUDED) : kinds.index(EventKind.READMITTED)]
        assert out.count(EventKind.DISCARD) == 2 and EventKind.COMMIT not in out
        assert server.run_in_loop(lambda: server.state.metrics.readmissions) == 1
    finally:
        a.shutdown()
        b.shutdown()
        server.shutdown()
