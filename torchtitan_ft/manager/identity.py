"""Whether replica groups run the same job: what a group says about itself, checked on group
rank 0's server against every quorum member (pure, except that fingerprints hash a model).

Docs: architecture.md, "Group consistency".
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from torchtitan_ft.lighthouse.types import Quorum


@dataclass(frozen=True)
class GroupIdentity:
    """What a replica group says about itself in ``QuorumMember.data`` (JSON), so that the
    members of a quorum can check they run the same job."""

    replica: str
    """Configured replica id, without the per-process uuid suffix ("" = none configured)."""
    model: str | None = None
    """Short model fingerprint (e.g. ``"ab12cd34: 10 params / 6.1M elements"``); None: unknown."""
    group_size: int | None = None
    """Planned number of replica groups; None: unknown."""

    @classmethod
    def resolve(
        cls, replica: str, model: str | Callable[[], str] | None, group_size: int | None
    ) -> GroupIdentity:
        """The identity of a group with a model fingerprint given as a string or a function
        (called here)."""
        return cls(
            replica=replica, model=model() if callable(model) else model, group_size=group_size
        )

    def to_data(self) -> dict[str, Any]:
        """The ``QuorumMember.data`` payload."""
        return {"replica": self.replica, "model": self.model, "group_size": self.group_size}

    @classmethod
    def from_data(cls, data: Any) -> GroupIdentity | None:
        """Decodes ``QuorumMember.data``; None when absent or not ours (e.g. a torchft member)."""
        if not isinstance(data, dict) or not isinstance(data.get("replica"), str):
            return None
        model, group_size = data.get("model"), data.get("group_size")
        return cls(
            replica=data["replica"],
            model=model if isinstance(model, str) else None,
            group_size=group_size if isinstance(group_size, int) else None,
        )


def identity_conflict(replica_id: str, quorum: Quorum) -> str | None:
    """The first way member ``replica_id`` is inconsistent with another member of ``quorum``,
    as one line that says what to do; None when consistent (or not checkable).

    Checked against every other member that sent an identity, in replica-id order: the same
    configured replica id (a second live group claims it), a different ``group_size``, a
    different model fingerprint.
    """
    members = {m.replica_id: GroupIdentity.from_data(m.data) for m in quorum.participants}
    mine = members.get(replica_id)
    if mine is None:
        return None
    for other_id in sorted(members):
        theirs = members[other_id]
        if other_id == replica_id or theirs is None:
            continue
        if mine.replica and theirs.replica == mine.replica:
            return (
                f"replica_id {mine.replica!r} is already used by a live replica group; give each "
                "group a distinct --fault_tolerance.replica_id (Manager replica_id / "
                "REPLICA_GROUP_ID)"
            )
        me, peer = _name(mine, replica_id), _name(theirs, other_id)
        if None not in (mine.group_size, theirs.group_size) and (
            mine.group_size != theirs.group_size
        ):
            return (
                f"replica group {me!r} expects group_size={mine.group_size} but {peer!r} "
                f"expects {theirs.group_size}; give every group the same "
                "--fault_tolerance.group_size"
            )
        if None not in (mine.model, theirs.model) and mine.model != theirs.model:
            return (
                f"replica group {me!r} runs a different model than {peer!r} (fingerprint "
                f"{mine.model} vs {theirs.model}); start every group with the same model config"
            )
    return None


def _name(identity: GroupIdentity, replica_id: str) -> str:
    return identity.replica or replica_id


def model_fingerprint(modules: torch.nn.Module | Iterable[torch.nn.Module]) -> str:
    """A short fingerprint of a model's parameter names, global shapes and dtypes, e.g.
    ``"ab12cd34: 10 params / 6.1M elements"``; equal models give equal fingerprints.

    For the Manager's ``model_fingerprint`` argument. Shapes are global (a DTensor's
    ``shape``), so groups sharded differently inside still agree; a meta-device model works.
    """
    parts = [modules] if isinstance(modules, torch.nn.Module) else list(modules)
    digest = hashlib.sha1()
    params = elements = 0
    for index, part in enumerate(parts):
        for name, param in part.named_parameters():
            digest.update(f"{index}.{name}:{tuple(param.shape)}:{param.dtype};".encode())
            params += 1
            elements += param.numel()
    return f"{digest.hexdigest()[:8]}: {params} params / {_human(elements)} elements"


def _human(n: int) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)
