"""Live healing on every rank: offer this rank's state to peers and receive a donor's on the
quorum thread, then apply the received state on the training thread, all or nothing.

Docs: architecture.md, "One step" (steps 6, 8 and 10) and "Why the healed state is applied
where it is".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, cast

import torch
from torch.profiler import record_function

from torchtitan_ft.checkpoint import CheckpointTransport
from torchtitan_ft.checkpoint.paths import PathUsed
from torchtitan_ft.events import EventKind, EventWriter, HealOutcome
from torchtitan_ft.manager.client import ManagerClient
from torchtitan_ft.manager.decisions import QuorumResult
from torchtitan_ft.manager.stats import Counters, tensor_bytes
from torchtitan_ft.proto import torchft_pb2 as pb


class Healing:
    """The user state one rank heals with, and the heal transfer of the current step.

    Threads: ``new_step`` runs on the training thread before the quorum thread starts,
    ``exchange`` on the quorum thread, ``apply_all_or_nothing`` and ``withdraw_stale_offer`` on
    the training thread once the quorum thread is done.

    Args:
        transport: moves the state between ranks (``HTTPTransport``, ``PGTransport``, ...).
        group_rank: this rank in its replica group; a healer asks the donor group's
            ManagerServer where the donor's rank with the same group rank serves its state.
        timeout: for the donor's ``CheckpointMetadata`` RPC and each transfer.
        connect_timeout: for connecting to the donor group's ManagerServer.
        auth_token: the job token, presented to the donor group's ManagerServer; ``None``
            presents none.
        counters: where heal bytes and times are counted.
        events: the event stream: ``HEAL_START`` and ``HEAL_END`` of each heal.
        log: the Manager's logger (level, message).
    """

    def __init__(
        self,
        transport: CheckpointTransport[Any],
        *,
        group_rank: int,
        timeout: timedelta,
        connect_timeout: timedelta,
        auth_token: str | None,
        counters: Counters,
        events: EventWriter,
        log: Callable[[int, str], None],
    ) -> None:
        self.transport = transport
        self._group_rank = group_rank
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        self._auth_token = auth_token
        self._counters = counters
        self._events = events
        self._log = log
        self._load_fns: dict[str, Callable[[Any], None]] = {}
        self._save_fns: dict[str, Callable[[], Any]] = {}
        self._pending: dict[str, Any] | None = None
        self._receive_seconds = 0.0
        self._received_bytes = 0
        self._borrowed = False
        self._served = False
        self._source = ""
        self._path = ""
        """The path the current heal's state comes over (``HEAL_END``'s ``path``)."""
        self._path_used: PathUsed | None = None
        """Its address, interface, probed rate and failed paths, when the transport said."""
        self._to_step = 0
        self._reports: list[pb.HealReport] = []

    # ---------------------------------------------------------------- user state

    def register(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        """Adds one named piece of user state to what healing sends and loads."""
        if key in self._load_fns:
            raise ValueError(f"state dict fn {key!r} is already registered")
        self._load_fns[key] = load_state_dict
        self._save_fns[key] = state_dict

    def replace(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        """Registers ``key``, replacing what was registered under it."""
        self._load_fns.pop(key, None)
        self._save_fns.pop(key, None)
        self.register(key, load_state_dict, state_dict)

    # ---------------------------------------------------------------- one step

    def new_step(self) -> None:
        """Forgets the previous step's transfer (training thread, before the quorum thread)."""
        self._pending = None
        self._served = False

    def exchange(self, result: QuorumResult, manager_state: dict[str, int]) -> None:
        """Offers our state to the peers healing from us and, if we heal, receives the donor's
        into a pending buffer (not applied). Quorum thread; raises what the transport raised."""
        if result.recover_dst_replica_ranks:
            self._log(
                logging.INFO,
                f"serving step {result.max_step} to replica ranks "
                f"{result.recover_dst_replica_ranks}",
            )
            self._served = True
            state = self._state_to_send(manager_state)
            with record_function("torchft::manager::_checkpoint_transport::send_checkpoint"):
                self.transport.send_checkpoint(
                    dst_ranks=result.recover_dst_replica_ranks,
                    step=result.max_step,
                    state_dict=state,
                    timeout=self._timeout,
                )
            sent = tensor_bytes(state) * len(result.recover_dst_replica_ranks)
            self._counters.add(heal_bytes_sent=sent)
        if result.heal:
            self._source = result.recover_src_manager_address
            self._path = ""
            self._path_used = None
            self._to_step = result.max_step
            self._events.emit(
                EventKind.HEAL_START,
                to_step=result.max_step,
                source_replica_rank=result.recover_src_replica_rank,
                source_address=result.recover_src_manager_address,
            )
            start = time.perf_counter()
            try:
                self._pending = self._receive(result)
            except Exception as e:
                self._heal_ended(HealOutcome.FAILED, time.perf_counter() - start, 0, e)
                raise
            self._receive_seconds = time.perf_counter() - start

    def _state_to_send(self, manager_state: dict[str, int]) -> dict[str, Any]:
        if not self._save_fns:
            raise RuntimeError(
                "a peer needs to heal from this replica but no state_dict function is "
                "registered (pass state_dict= or call register_state_dict_fn)"
            )
        return {
            "user": {key: fn() for key, fn in self._save_fns.items()},
            "torchft": manager_state,
        }

    def _receive(self, result: QuorumResult) -> dict[str, Any]:
        src_rank = result.recover_src_replica_rank
        if src_rank is None:
            raise RuntimeError(f"quorum {result.quorum_id} says heal but names no source rank")
        self._log(
            logging.INFO,
            f"healing to step {result.max_step} from replica rank {src_rank} "
            f"({result.recover_src_manager_address})",
        )
        source = ManagerClient(
            result.recover_src_manager_address,
            connect_timeout=self._connect_timeout,
            auth_token=self._auth_token,
        )
        try:
            metadata = source._checkpoint_metadata(self._group_rank, timeout=self._timeout)
        finally:
            source.close(wait=False)  # a wait here would delay the heal by up to 0.2 s
        # Borrowed: views of the transport's reused receive buffer (no page faults after the
        # first heal); apply_all_or_nothing copies them into the live state.
        recv = getattr(self.transport, "recv_checkpoint_borrowed", None)
        self._borrowed = recv is not None
        self._path = "process group" if metadata == "<n/a>" else metadata
        before = getattr(self.transport, "last_path", None)
        with record_function("torchft::manager::_checkpoint_transport::recv_checkpoint"):
            state = (recv or self.transport.recv_checkpoint)(
                src_rank=src_rank, metadata=metadata, step=result.max_step, timeout=self._timeout
            )
        used = getattr(self.transport, "last_path", None)
        if isinstance(used, PathUsed) and used is not before:  # HTTPTransport's, this receive's
            self._path, self._path_used = used.label(), used
        self._received_bytes = tensor_bytes(state)
        self._counters.add(heal_bytes_received=self._received_bytes)
        _check_healed_state(state, self._load_fns.keys(), result.max_step)
        return cast(dict[str, Any], state)

    def apply_all_or_nothing(
        self,
        *,
        healing: bool,
        group_and: Callable[[bool], bool],
        report_error: Callable[[BaseException], None],
        load_manager_state: Callable[[dict[str, int]], None],
    ) -> None:
        """Applies the received state if every rank of the replica group received its own
        (training thread, when the group may heal this step): ``group_and`` of "I received my
        state, or had none to receive"; the user state, then the Manager's step
        (``load_manager_state``). Otherwise nothing is applied and ``report_error`` records
        why. A state received into the transport's reused buffer is first copied into the
        live tensors it replaces (``land_in_place``), and the load functions get those.

        All or nothing, so a group's ranks never end up at different steps; and independent of
        the step's commit vote, so replicas behind can catch up even while too few replicas are
        at the max step for any step to commit (otherwise a livelock).

        Raises:
            RuntimeError: a load failed; the other ranks applied theirs, so this group can no
                longer be made consistent.
        """
        received = not healing or self._pending is not None
        if not group_and(received):
            if received:
                error = RuntimeError("another rank of this replica group failed to heal")
                if self._pending is not None:
                    self._heal_ended(
                        HealOutcome.NOT_APPLIED, self._receive_seconds, self._received_bytes, error
                    )
                report_error(error)
            return
        pending, self._pending = self._pending, None
        if pending is None:
            return
        start = time.perf_counter()
        try:
            for key, load in self._load_fns.items():
                received = pending["user"][key]
                if self._borrowed:
                    received = land_in_place(received, self._save_fns[key]())
                load(received)
            load_manager_state(pending["torchft"])
        except Exception as e:
            raise RuntimeError(
                f"every rank of the replica group received its healed state but this rank "
                f"could not load it: {e}; is the model the same in every group?"
            ) from e
        seconds = self._receive_seconds + time.perf_counter() - start
        self._counters.heal_applied(seconds)
        step = pending["torchft"]["step"]
        self._log(logging.INFO, f"applied healed state of step {step} ({seconds:.3f} s)")
        self._heal_ended(HealOutcome.APPLIED, seconds, self._received_bytes, None)

    def _heal_ended(
        self, outcome: HealOutcome, seconds: float, received: int, error: BaseException | None
    ) -> None:
        self._reports.append(
            pb.HealReport(
                to_step=self._to_step,
                source_address=self._source,
                bytes=received,
                seconds=seconds,
                outcome=outcome.value,
                started=time.time() - seconds,
            )
        )
        used = self._path_used
        detail = (
            {}
            if used is None
            else {
                "path_address": used.address,
                "path_interface": used.interface,
                "path_probe_mb_s": None if used.probe_mb_s is None else round(used.probe_mb_s, 1),
                "path_failures": list(used.failures),
            }
        )
        self._events.emit(
            EventKind.HEAL_END,
            outcome=outcome,
            seconds=round(seconds, 6),
            bytes=received,
            path=self._path,
            error="" if error is None else f"{type(error).__name__}: {error}",
            **detail,
        )

    def take_reports(self) -> list[pb.HealReport]:
        """The heals that ended since the last call, for the lighthouse (``GroupProgress``).
        Training thread, once the previous step's quorum thread is done (``start_quorum``)."""
        reports, self._reports = self._reports, []
        return reports

    def withdraw_stale_offer(self) -> None:
        """Withdraws the offer of an earlier step unless this step served one (training thread,
        at the commit vote).

        An offer is withdrawn one step late: healers of the quorum that made it may still be
        fetching after the donor commits (the donor does not wait for them), and none can join
        the next quorum (which this commit needed) before finishing.
        """
        if not self._served:
            self.transport.disallow_checkpoint()


def land_in_place(received: Any, live: Any) -> Any:
    """``received`` with every tensor leaf moved out of a borrowed receive buffer: copied into
    the tensor at the same place of ``live`` (this rank's current state) when that is a plain
    tensor of the same shape and dtype (the leaf becomes that live tensor; a copy to its
    device), else cloned. Other leaves are returned as received.

    The load function then gets the rank's own storage back (``nn.Module.load_state_dict``
    copies a tensor onto itself: nothing; an optimizer keeps its own tensors), and nothing
    refers to the receive buffer, which the next heal overwrites. Only called once the whole
    state arrived, was checked and the group agreed: live tensors are written only then.
    """
    if isinstance(received, torch.Tensor):
        if _same_kind(received, live):
            with torch.no_grad():
                live.copy_(received)
            return live
        return received.clone()
    if isinstance(received, dict):
        live_map = live if isinstance(live, Mapping) else {}
        return {k: land_in_place(v, live_map.get(k)) for k, v in received.items()}
    if isinstance(received, list | tuple):
        live_seq = live if isinstance(live, list | tuple) and len(live) == len(received) else ()
        leaves = [
            land_in_place(v, live_seq[i] if live_seq else None) for i, v in enumerate(received)
        ]
        return type(received)(leaves) if isinstance(received, tuple) else leaves
    return received


def _same_kind(received: torch.Tensor, live: Any) -> bool:
    # Plain tensors only: a DTensor's placement is the receiver's own (rebuilt on its mesh).
    return (
        type(received) is torch.Tensor
        and isinstance(live, torch.Tensor)
        and type(live) in (torch.Tensor, torch.nn.Parameter)
        and live.shape == received.shape
        and live.dtype == received.dtype
        and not live.is_meta
    )


def _check_healed_state(state: Any, keys: Any, step: int) -> None:
    """Rejects a received state that cannot be applied whole (before anything is loaded)."""
    if not isinstance(state, dict) or "user" not in state or "torchft" not in state:
        raise RuntimeError("received checkpoint lacks the 'user' and 'torchft' parts")
    missing = [k for k in keys if k not in state["user"]]
    if missing:
        raise RuntimeError(f"received checkpoint lacks user state {missing}")
    got = state["torchft"].get("step")
    if got != step:
        raise RuntimeError(f"received checkpoint of step {got}, expected step {step}")
