"""In-process replica groups for the sync-strategy tests: a stand-in for the lighthouse, the
Managers and the cross-group process group of n replica groups running as threads.

``SimulatedReplicaGroups(n).manager(replica_id)`` returns a ``SimulatedManager`` with the
``Manager`` methods the strategies use (torchft 0.2.0 names). What it models:

- **Quorum**: ``start_quorum`` waits until every live member of the previous quorum has asked
  (the first quorum: ``min_replicas`` replicas), and includes newcomers already waiting. Members
  behind the highest step heal from a member at that step (all registered state-dict
  functions, deep-copied); at step 0 with ``init_sync`` every member but the first heals.
- **Allreduce**: completes when every quorum member has contributed; the sum is taken in member
  order, so all members get bit-identical results. ``should_quantize`` runs the real int8
  algorithm of ``torchtitan_ft.process_group.quantized`` over a process group made of threads.
- **Failures**: ``fail_next_collective()`` / ``fail_collective_at(n)`` make the next (or the
  n-th) collective fail on every member; ``kill(replica_id)`` fails the collectives the dead
  member was part of, and later quorums drop it. A member that records an error fails the
  collectives it had pending (as an aborted process group would) and skips later ones.
- **Bytes**: ``wire_bytes(replica_id)``: ``2 (N-1)/N`` of the tensor per fp32 allreduce (a ring
  allreduce), the exact buffers of the quantized algorithm otherwise.

The real Manager is tested in ``tests/manager/``.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed import ReduceOp

from torchtitan_ft.process_group.futures import completed_future
from torchtitan_ft.process_group.quantized import quantized_allreduce
from torchtitan_ft.semi_sync.config import QuorumMode


class CollectiveError(RuntimeError):
    """A simulated collective failed (injected failure or a dead member)."""


class _Collection:
    """One collective call across the quorum: every member's contribution, then the result."""

    def __init__(self, members: list[str]) -> None:
        self.members = members
        self.values: dict[str, Any] = {}
        self.futures: dict[str, torch.futures.Future[dict[str, Any]]] = {}
        self.done = False
        self.number = -1
        self.key: tuple[int, int] = (-1, -1)


class SimulatedReplicaGroups:
    """N replica groups in one process (one thread each), sharing a simulated lighthouse.

    Args:
        min_replicas: replica groups the first quorum waits for.
        quorum_mode: what the managers report as their quorum mode (``use_async_quorum``;
            the simulation itself always forms quorums synchronously).
        init_sync: at step 0 every member but the first heals from it (as torchft's
            ``init_sync``), so all start from the same parameters.
        timeout: seconds any wait may take before ``TimeoutError``.
    """

    def __init__(
        self,
        min_replicas: int,
        quorum_mode: QuorumMode = QuorumMode.SYNC,
        init_sync: bool = True,
        timeout: float = 60.0,
    ) -> None:
        if min_replicas < 1:
            raise ValueError(f"min_replicas must be >= 1, got {min_replicas}")
        self.min_replicas = min_replicas
        self.quorum_mode = QuorumMode(quorum_mode)
        self.init_sync = init_sync
        self.timeout = timeout
        self._cond = threading.Condition()
        self._managers: dict[str, SimulatedManager] = {}
        self._killed: set[str] = set()
        self._members: list[str] = []
        self._quorum_id = 0
        self._arrived: set[str] = set()
        self._generation = 0
        self._collections: dict[tuple[int, int], _Collection] = {}
        self._fail_next = 0
        self._fail_at: set[int] = set()
        self._created = 0
        self._bytes_sent: dict[str, int] = {}

    def manager(
        self,
        replica_id: str,
        load_state_dict: Callable[[Any], None] | None = None,
        state_dict: Callable[[], Any] | None = None,
    ) -> SimulatedManager:
        """A new manager for replica group ``replica_id`` (a newcomer joins at the next quorum).

        ``load_state_dict``/``state_dict`` are the user's state (model, inner optimizer), healed
        like torchft's (registered under ``"default"``, before anything else).
        """
        with self._cond:
            if replica_id in self._managers and replica_id not in self._killed:
                raise ValueError(f"replica {replica_id!r} already has a live manager")
            self._killed.discard(replica_id)
            self._bytes_sent[replica_id] = 0
            mgr = SimulatedManager(self, replica_id)
            self._managers[replica_id] = mgr
        if load_state_dict is not None and state_dict is not None:
            mgr.register_state_dict_fn("default", load_state_dict, state_dict)
        return mgr

    def wire_bytes(self, replica_id: str) -> int:
        """Bytes replica group ``replica_id`` has sent to other groups."""
        with self._cond:
            return self._bytes_sent[replica_id]

    def fail_next_collective(self, count: int = 1) -> None:
        """Makes the next ``count`` collectives fail on every member."""
        with self._cond:
            self._fail_next += count

    def fail_collective_at(self, *numbers: int) -> None:
        """Makes the collectives with these 0-based creation numbers fail on every member
        (collectives are numbered in the order their first contribution arrives)."""
        with self._cond:
            self._fail_at.update(numbers)

    def kill(self, replica_id: str) -> None:
        """Marks ``replica_id`` dead: its pending collectives fail, later quorums drop it."""
        with self._cond:
            self._killed.add(replica_id)
            self._arrived.discard(replica_id)
            for coll in list(self._collections.values()):
                if replica_id in coll.members and not coll.done:
                    self._finish(coll, CollectiveError(f"replica {replica_id} died"))
            self._maybe_issue_quorum()
            self._cond.notify_all()

    # -- quorum ---------------------------------------------------------------------------

    def _quorum(self, mgr: SimulatedManager) -> None:
        with self._cond:
            self._arrived.add(mgr.replica_id)
            generation = self._generation
            self._maybe_issue_quorum()
            if not self._cond.wait_for(lambda: self._generation > generation, self.timeout):
                raise TimeoutError(f"replica {mgr.replica_id}: no quorum in {self.timeout}s")

    def _maybe_issue_quorum(self) -> None:
        if not self._arrived:
            return
        previous = [m for m in self._members if m not in self._killed]
        if previous:
            if not set(previous) <= self._arrived:
                return
        elif len(self._arrived) < self.min_replicas:
            return
        members = sorted(self._arrived)
        if members != self._members:
            self._quorum_id += 1
        self._members = members
        self._arrived = set()
        self._heal(members)
        for m in members:
            self._managers[m]._on_quorum(self._quorum_id, self._generation, members)
        self._generation += 1
        self._cond.notify_all()

    def _heal(self, members: list[str]) -> None:
        steps = {m: self._managers[m]._step for m in members}
        max_step = max(steps.values())
        donors = [m for m in members if steps[m] == max_step]
        donor = self._managers[donors[0]]
        for m in members:
            behind = steps[m] < max_step
            init = self.init_sync and max_step == 0 and m != donors[0]
            if not (behind or init):
                continue
            target = self._managers[m]
            state = {key: copy.deepcopy(save()) for key, (_, save) in donor._fns.items()}
            for key, (load, _) in target._fns.items():
                if key in state:
                    load(state[key])
            target._step = max_step
            target.healed_count += 1

    # -- collectives ------------------------------------------------------------------------

    def _collect(
        self, mgr: SimulatedManager, value: Any, count_bytes: int = 0
    ) -> torch.futures.Future[dict[str, Any]]:
        """Contributes ``value`` to the member's next collective; the future gets all values."""
        fut: torch.futures.Future[dict[str, Any]] = torch.futures.Future()
        with self._cond:
            if mgr._error is not None:
                # Checked under the lock that report_error takes: a member that errored after
                # its caller last looked must not join (its peers no longer would).
                fut.set_exception(CollectiveError(f"replica {mgr.replica_id} already errored"))
                return fut
            key = (mgr._generation, mgr._seq)
            mgr._seq += 1
            coll = self._collections.get(key)
            if coll is None:
                coll = _Collection(list(mgr._members))
                coll.number = self._created
                coll.key = key
                self._created += 1
                self._collections[key] = coll
            if coll.done:
                fut.set_exception(CollectiveError("collective already failed"))
                return fut
            if mgr._error is not None:
                # Checked under the lock report_error takes: a member that errored after its
                # caller last looked must not join (its peers no longer would).
                fut.set_exception(CollectiveError(f"replica {mgr.replica_id} already errored"))
                return fut
            coll.values[mgr.replica_id] = value
            coll.futures[mgr.replica_id] = fut
            self._bytes_sent[mgr.replica_id] += count_bytes
            dead = [m for m in coll.members if m in self._killed]
            if dead:
                self._finish(coll, CollectiveError(f"replicas {dead} died"))
            elif len(coll.values) == len(coll.members):
                if self._fail_next > 0 or coll.number in self._fail_at:
                    self._fail_next = max(0, self._fail_next - 1)
                    self._finish(coll, CollectiveError("injected collective failure"))
                else:
                    self._finish(coll, None)
        return fut

    def _abort(self, mgr: SimulatedManager) -> None:
        """Fails the pending collectives ``mgr`` takes part in (it errored: like an aborted
        process group, its later collectives are no-ops, so peers must not wait for them)."""
        with self._cond:
            for coll in list(self._collections.values()):
                mine = mgr.replica_id in coll.members and coll.key[0] == mgr._generation
                if mine and not coll.done:
                    self._finish(coll, CollectiveError(f"replica {mgr.replica_id} errored"))

    def _finish(self, coll: _Collection, error: Exception | None) -> None:
        coll.done = True
        values, coll.values = coll.values, {}
        futures, coll.futures = coll.futures, {}
        if error is None:
            # Everyone contributed: nobody will look this collective up again.
            self._collections.pop(coll.key, None)
        for fut in futures.values():
            if error is None:
                fut.set_result(values)
            else:
                fut.set_exception(error)
        self._cond.notify_all()


class _ThreadGroup:
    """The two collectives ``quantized_allreduce`` uses (``alltoall_base``, ``allgather``), across
    the members of a simulated quorum, counting what leaves this member: an alltoall its
    ``N-1`` chunks for the others, an allgather ``N-1`` copies of its own tensor."""

    def __init__(self, groups: SimulatedReplicaGroups, mgr: SimulatedManager) -> None:
        self._groups = groups
        self._mgr = mgr
        self._members = list(mgr._members)

    def rank(self) -> int:
        return self._members.index(self._mgr.replica_id)

    def size(self) -> int:
        return len(self._members)

    def alltoall_base(
        self, output: torch.Tensor, input: torch.Tensor, *_: Any
    ) -> torch.futures.Future[Any]:
        chunks = input.chunk(self.size())
        sent = sum(c.numel() * c.element_size() for i, c in enumerate(chunks) if i != self.rank())
        values = self._groups._collect(self._mgr, [c.clone() for c in chunks], sent).wait()
        output.copy_(torch.cat([values[m][self.rank()] for m in self._members]))
        return completed_future(None)

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], *_: Any
    ) -> torch.futures.Future[Any]:
        (tensor,) = inputs
        sent = (self.size() - 1) * tensor.numel() * tensor.element_size()
        values = self._groups._collect(self._mgr, tensor.clone(), sent).wait()
        for out, member in zip(outputs[0], self._members, strict=True):
            out.copy_(values[member])
        return completed_future(None)


class SimulatedManager:
    """The Manager contract for one simulated replica group (see ``SimulatedReplicaGroups``)."""

    def __init__(self, groups: SimulatedReplicaGroups, replica_id: str) -> None:
        self._groups = groups
        self.replica_id = replica_id
        self.use_async_quorum = groups.quorum_mode is QuorumMode.ASYNC
        self._fns: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]] = {}
        self._step = 0
        self._quorum_id = -1
        self._generation = -1
        self._members: list[str] = []
        self._seq = 0
        self._error: Exception | None = None
        self.healed_count = 0
        """How many times this replica healed from a peer."""
        self.commits = 0
        self.failed_commits = 0

    def _on_quorum(self, quorum_id: int, generation: int, members: list[str]) -> None:
        self._quorum_id = quorum_id
        self._generation = generation
        self._members = list(members)
        self._seq = 0
        self._error = None

    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        """Adds ``key`` to what this replica sends/receives when healing."""
        if key in self._fns:
            raise ValueError(f"state dict key {key!r} already registered")
        self._fns[key] = (load_state_dict, state_dict)

    def start_quorum(
        self, allow_heal: bool = True, shrink_only: bool = False, timeout: Any = None
    ) -> None:
        """Forms the next quorum (blocking), healing this replica if it is behind."""
        del allow_heal, shrink_only, timeout
        self._groups._quorum(self)

    def wait_quorum(self) -> None:
        """No-op: ``start_quorum`` already waited."""

    def allreduce(
        self,
        tensor: torch.Tensor,
        should_quantize: bool = False,
        reduce_op: ReduceOp.RedOpType = ReduceOp.AVG,
    ) -> torch.futures.Future[torch.Tensor]:
        """Averages (or sums) ``tensor`` in place across the quorum.

        On error the error is recorded and the returned future holds ``tensor`` unchanged.
        """
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        if self._error is not None:
            done.set_result(tensor)
            return done
        n = len(self._members)
        if should_quantize:
            fut = quantized_allreduce(tensor, _ThreadGroup(self._groups, self), reduce_op)
            try:
                fut.wait()
            except CollectiveError as e:
                self.report_error(e)
            done.set_result(tensor)
            return done

        nbytes = tensor.numel() * tensor.element_size()
        fut = self._groups._collect(self, tensor.detach().clone(), 2 * (n - 1) * nbytes // n)
        members = list(self._members)

        def apply(f: torch.futures.Future[dict[str, Any]]) -> torch.Tensor:
            try:
                values = f.wait()
            except CollectiveError as e:
                self.report_error(e)
                return tensor
            total = values[members[0]].clone()
            for m in members[1:]:
                total += values[m]
            if reduce_op == ReduceOp.AVG:
                total /= n
            with torch.no_grad():
                tensor.copy_(total)
            return tensor

        return fut.then(apply)

    def should_commit(self, timeout: Any = None) -> bool:
        """True if no error was recorded since the quorum; advances the step on commit."""
        del timeout
        if self._error is not None:
            self.failed_commits += 1
            return False
        self._step += 1
        self.commits += 1
        return True

    def report_error(self, e: Exception) -> None:
        """Records ``e``; later collectives are no-ops and the commit vote says no."""
        with self._groups._cond:  # the lock _collect checks the error under
            first = self._error is None
            self._error = e
            if first:
                self._groups._abort(self)

    def errored(self) -> Exception | None:
        """The error recorded since the last quorum, if any."""
        return self._error

    def current_step(self) -> int:
        """Committed steps (healed to the quorum's highest step)."""
        return self._step

    def num_participants(self) -> int:
        """Members of the current quorum."""
        return len(self._members)

    def is_participating(self) -> bool:
        """Always True (healing is synchronous here)."""
        return True
