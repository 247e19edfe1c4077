"""``StepLedger``: the Manager's step account, table-tested without processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from torchtitan_ft.events import EventKind, open_event_writer, read_events
from torchtitan_ft.manager.decisions import CommitVote
from torchtitan_ft.manager.ledger import StepLedger
from torchtitan_ft.manager.stats import Counters


def _ledger(tmp_path: Path, max_retries: int | None) -> tuple[StepLedger, Counters]:
    counters = Counters()
    events = open_event_writer(str(tmp_path), "r", 0, lambda: 0)
    return StepLedger(max_retries, counters, events), counters


@pytest.mark.parametrize(
    ("committed", "vote", "reason"),
    [
        (True, CommitVote(True, "2 participants, no error"), None),
        (False, CommitVote(False, "error this step: boom"), "error this step: boom"),
        (False, CommitVote(True, "2 participants"), "another rank of the replica group voted no"),
    ],
)
def test_a_vote_commits_or_discards_for_the_right_reason(
    tmp_path: Path, committed: bool, vote: CommitVote, reason: str | None
) -> None:
    ledger, counters = _ledger(tmp_path, None)
    ledger.record_vote(committed, 2, vote)
    assert (ledger.step, ledger.batches_committed) == ((1, 2) if committed else (0, 0))
    assert (ledger.commit_failures, ledger.discarded_steps) == ((0, 0) if committed else (1, 1))
    assert counters.snapshot()["steps_discarded"] == (0 if committed else 1)
    (event,) = read_events(tmp_path)
    assert event.kind is (EventKind.COMMIT if committed else EventKind.DISCARD)
    assert (event.data.get("reason"), event.data["participants"]) == (reason, 2)


def test_failed_commits_past_max_retries_raise_and_a_left_out_step_does_not_count(
    tmp_path: Path,
) -> None:
    ledger, _ = _ledger(tmp_path, 1)
    ledger.discard(0, "left out", failed=False)
    ledger.discard(0, "left out", failed=False)
    assert (ledger.commit_failures, ledger.discarded_steps) == (0, 2)
    ledger.discard(2, "error")
    with pytest.raises(RuntimeError, match="failed 2 times in a row, exceeding max_retries=1"):
        ledger.discard(2, "error")
    ledger.commit(2)
    assert ledger.commit_failures == 0
    ledger.load_state_dict({"step": 7, "batches_committed": 9})
    assert ledger.state_dict() == {"step": 7, "batches_committed": 9}
