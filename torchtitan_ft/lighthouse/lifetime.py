"""When a lighthouse that serves one job run may stop by itself (``torchft_lighthouse
--exit_when_idle_ms``): a launcher that starts the lighthouse beside the replica groups, as one
application (``torchtitan_ft.torchx``), ends only once every process of it has ended, so its
lighthouse must end when the job does. Pure: the CLI feeds it what the lighthouse sees."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Idle:
    """What the lifetime rule remembers between two looks: whether the job ever had a quorum,
    and since when no replica group has been healthy (None: one is now)."""

    served: bool = False
    since: float | None = None


def look(previous: Idle, has_quorum: bool, healthy_groups: int, now: float) -> Idle:
    """The state after a look at ``now`` (seconds, monotonic): ``has_quorum``, whether the
    lighthouse has issued a quorum; ``healthy_groups``, how many groups it hears from."""
    served = previous.served or has_quorum
    if healthy_groups > 0:
        return Idle(served, None)
    return Idle(served, previous.since if previous.since is not None else now)


def should_exit(idle: Idle, now: float, idle_s: float) -> bool:
    """True once the job has been served and no group has been healthy for ``idle_s``
    seconds. A lighthouse that never issued a quorum waits on (its groups may still be
    starting); a group that restarts within ``idle_s`` keeps it up."""
    return idle.served and idle.since is not None and now - idle.since >= idle_s
