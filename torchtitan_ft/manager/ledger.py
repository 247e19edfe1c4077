"""The Manager's account of its steps: the committed step count and batches (what its
``state_dict`` checkpoints), the consecutive failed commits (``max_retries``) and the discarded
steps; each commit and discard is also an event (``COMMIT``, ``DISCARD``) and a discard a
counter (``steps_discarded``).
"""

from __future__ import annotations

from torchtitan_ft.events import EventKind, EventWriter
from torchtitan_ft.manager.decisions import CommitVote, check_commit_failures
from torchtitan_ft.manager.stats import Counters


class StepLedger:
    """One rank's step account (training thread; ``Manager.stats()`` reads it from any).

    Args:
        max_retries: the Manager's: consecutive failed commits allowed (None: no limit).
        counters: where discarded steps are counted.
        events: the event stream.
    """

    def __init__(self, max_retries: int | None, counters: Counters, events: EventWriter) -> None:
        self._max_retries = max_retries
        self._counters = counters
        self._events = events
        self.step = 0
        """Committed steps."""
        self.batches_committed = 0
        """Sum over committed steps of their participants."""
        self.commit_failures = 0
        """Consecutive failed commits (reset by a commit)."""
        self.discarded_steps = 0
        """Steps not committed, failed or left out."""

    def commit(self, participants: int) -> None:
        """A step over ``participants`` replica groups committed."""
        self.step += 1
        self.batches_committed += participants
        self.commit_failures = 0
        self._events.emit(EventKind.COMMIT, participants=participants)

    def record_vote(self, committed: bool, participants: int, local_vote: CommitVote) -> None:
        """The replica group's vote on a step over ``participants`` groups: a commit, or a
        failed commit (``discard``) for this rank's reason, or because another rank voted no.

        Raises:
            RuntimeError: more than ``max_retries`` consecutive failures.
        """
        if committed:
            self.commit(participants)
        elif not local_vote.should_commit:
            self.discard(participants, local_vote.reason)
        else:
            self.discard(participants, "another rank of the replica group voted no")

    def discard(self, participants: int, reason: str, *, failed: bool = True) -> None:
        """A step over ``participants`` replica groups was discarded for ``reason``.
        ``failed``: its commit failed (one more consecutive failure); False for a step the
        straggler policy left out, which ``max_retries`` does not count.

        Raises:
            RuntimeError: more than ``max_retries`` consecutive failures.
        """
        if failed:
            self.commit_failures += 1
        self.discarded_steps += 1
        self._counters.add(steps_discarded=1)
        self._events.emit(EventKind.DISCARD, participants=participants, reason=reason)
        if failed:
            check_commit_failures(self.commit_failures, self._max_retries)

    def state_dict(self) -> dict[str, int]:
        """The committed step and batches, for checkpoints."""
        return {"step": self.step, "batches_committed": self.batches_committed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Restores ``state_dict()`` output."""
        self.step = int(state_dict["step"])
        self.batches_committed = int(state_dict["batches_committed"])
