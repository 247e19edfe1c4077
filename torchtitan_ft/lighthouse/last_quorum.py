"""The last issued quorum, kept under ``--state_dir`` so that a restarted lighthouse decides as
the one before it would have.

What it carries across a restart: the quorum's members with their steps, and which of them
ended their heartbeat stream since (their process is gone). Not its id: the first quorum after
a restart gets a new one all the same, so every group rebuilds its process groups as after a
restart without it (lighthouse.md, "Restart safety").

A lighthouse that restarts without it knows no previous quorum: its state guard
(``decision.state_guard``) cannot act until it has issued one, so fresh replacements asking
alone at step 0 could train a second line of steps while the one group holding the job's state
is silent for a moment (in a collective timeout, stopped). Restored, the guard waits for that
group as before; members not heard from since the restart count as heard from at the restart
(``heard_since_restart``), so the guard's window runs from there.

``last_quorum.json`` is rewritten whole (a temporary file swapped in with ``os.replace``, no
fsync: a lighthouse process that dies loses nothing, a machine that crashes may keep the
previous version): at once when the quorum's membership changes, a member ends, or its steps
first pass 0, otherwise at most once per ``WRITE_INTERVAL_S`` while its steps move on. The
steps restored may be that much behind, which only makes the guard wait for a replica at a
slightly lower step.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FILE = "last_quorum.json"
WRITE_INTERVAL_S = 1.0
"""Longest time a change of the quorum's steps alone waits to be written."""


@dataclass(frozen=True)
class LastQuorum:
    steps: Mapping[str, int]
    """Each member's replica_id and the step it asked at."""
    ended: frozenset[str] = frozenset()
    """Members whose heartbeat stream ended since the quorum was issued (process gone)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "steps": dict(sorted(self.steps.items())),
            "ended": sorted(self.ended),
        }

    @staticmethod
    def from_json(d: Any) -> LastQuorum:
        """Raises ValueError naming what is wrong with ``d``."""
        if not isinstance(d, dict):
            raise ValueError(f"expected a JSON object, got {type(d).__name__}")
        steps, ended = d.get("steps"), d.get("ended", [])
        if not isinstance(steps, dict) or not steps:
            raise ValueError(f"steps must be a non-empty object, got {steps!r}")
        for rid, step in steps.items():
            if not rid or not isinstance(step, int) or step < 0:
                raise ValueError(f"steps[{rid!r}] must be an integer >= 0, got {step!r}")
        if not isinstance(ended, list) or not all(isinstance(r, str) for r in ended):
            raise ValueError(f"ended must be a list of replica ids, got {ended!r}")
        return LastQuorum(dict(steps), frozenset(ended))


def heard_since_restart(
    restored: Iterable[str],
    ended: Set[str],
    heartbeats: Mapping[str, float],
    restarted_at: float,
) -> dict[str, float]:
    """When each member of the quorum a restarted lighthouse restored (``restored``) was last
    heard from, as its state guard counts it: a heartbeat since the restart, else the restart
    itself (it may be stopped, or reconnecting); a member whose stream ended (``ended``,
    before or since the restart) is not counted: its process is gone."""
    heard = {rid: restarted_at for rid in restored if rid not in ended}
    heard.update(heartbeats)
    return heard


def write_due(written: LastQuorum | None, current: LastQuorum, since_write_s: float) -> bool:
    """Whether ``current`` must be written now: new members or an ended member at once, and
    the first step past 0 (a record at step 0 guards nothing: a fresh replacement is at step 0
    too); other new steps after ``WRITE_INTERVAL_S``."""
    if written is None or written.steps.keys() != current.steps.keys():
        return True
    if written.ended != current.ended:
        return True
    if max(written.steps.values()) == 0 < max(current.steps.values()):
        return True
    return written.steps != current.steps and since_write_s >= WRITE_INTERVAL_S


class LastQuorumFile:
    """``last_quorum.json`` in ``state_dir`` (see the module doc)."""

    def __init__(self, state_dir: str) -> None:
        self.path = Path(state_dir) / FILE
        self._broken = False

    def load(self) -> LastQuorum | None:
        """The record of an earlier run, or None (no file; a damaged one is skipped with a
        warning: the lighthouse then starts as without it)."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        try:
            return LastQuorum.from_json(json.loads(text))
        except ValueError as e:
            logger.warning(
                "lighthouse: ignoring %s (%s); the state guard cannot act until the first quorum",
                self.path,
                e,
            )
            return None

    def save(self, record: LastQuorum) -> None:
        """Writes ``record``; a failure (a full disk) is said once and writing stops."""
        if self._broken:
            return
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(record.to_json()), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as e:
            self._broken = True
            logger.warning(
                "lighthouse: cannot write %s (%s); a restarted lighthouse will not know the "
                "last quorum",
                self.path,
                e.strerror or e,
            )


def restored_line(record: LastQuorum, path: Path) -> str:
    """The one line a restarted lighthouse logs about what it restored."""
    gone = f", {len(record.ended)} of them gone before the restart" if record.ended else ""
    return (
        f"restored the last quorum from {path} ({len(record.steps)} member(s){gone}, max "
        f"step {max(record.steps.values())}): the state guard acts as before the restart"
    )
