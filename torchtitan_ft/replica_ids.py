"""The replica-id format, built and parsed here only, in every process of a job.

A replica group's id, as the lighthouse, quorums and event files see it, is
``<name>:<incarnation>``: the configured name (a TorchTitan job's groups are
``torchtitan_ft_<G>``; elsewhere any string, e.g. ``replica_3``) and a per-process uuid the
Manager appends, so that a restarted group joins as a new member. An empty name gives the uuid
alone. The group number is the trailing digits of the name.
"""

from __future__ import annotations

import re

TITAN_PREFIX = "torchtitan_ft_"
"""The name of a TorchTitan job's replica group ``G`` is this prefix and ``G``."""

_TRAILING_DIGITS = re.compile(r"(\d+)$")


def titan_replica_name(group: int) -> str:
    """The name of a TorchTitan job's replica group ``group`` (``torchtitan_ft_<group>``)."""
    return f"{TITAN_PREFIX}{group}"


def process_replica_id(name: str, incarnation: str) -> str:
    """The id one process of group ``name`` joins with: ``<name>:<incarnation>`` (the
    incarnation alone when ``name`` is empty)."""
    return f"{name}:{incarnation}" if name else incarnation


def replica_name(replica_id: str) -> str:
    """The group's name: ``replica_id`` without its per-process suffix (after the last colon);
    an id without one is its own name."""
    return replica_id.rsplit(":", 1)[0]


def group_number(replica_id: str, default: int | None = None) -> int:
    """The replica group number: the trailing digits of the id's name
    (``"torchtitan_ft_3:<uuid>"`` -> 3).

    Raises:
        ValueError: the name ends in no digit and no ``default`` is given.
    """
    name = replica_name(replica_id)
    match = _TRAILING_DIGITS.search(name)
    if match:
        return int(match.group(1))
    if default is None:
        raise ValueError(f"replica id {replica_id!r}: its name {name!r} ends in no group number")
    return default
