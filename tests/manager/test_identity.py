"""Whether replica groups run the same job (``torchtitan_ft.manager.identity``): identities in
``QuorumMember.data``, the conflicts between them, model fingerprints."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
import torch

from torchtitan_ft.lighthouse.types import Quorum, QuorumMember
from torchtitan_ft.manager.identity import GroupIdentity, identity_conflict, model_fingerprint


def _members(*identities: tuple[str, dict | None]) -> Quorum:
    return Quorum(
        quorum_id=3,
        participants=tuple(QuorumMember(replica_id=rid, data=data) for rid, data in identities),
        created=datetime.now(UTC),
    )


FP_A = "ab12cd34: 10 params / 6.1M elements"
FP_B = "9f3e0a11: 10 params / 7.2M elements"


def test_identity_round_trips_through_member_data() -> None:
    identity = GroupIdentity(replica="ft_0", model=FP_A, group_size=2)
    data = identity.to_data()
    assert data == {"replica": "ft_0", "model": FP_A, "group_size": 2}
    assert GroupIdentity.from_data(data) == identity
    # torchft members send no data or data of their own: not an identity
    for foreign in (None, {}, {"from": "a"}, [1, 2], "text", {"replica": 3}):
        assert GroupIdentity.from_data(foreign) is None
    # unknown fields ignored, wrongly typed optional fields read as unknown
    partial = {"replica": "x", "model": 5, "group_size": "2", "extra": True}
    assert GroupIdentity.from_data(partial) == GroupIdentity("x", None, None)


def _ident(replica: str, model: str | None = FP_A, group_size: int | None = 2) -> dict:
    return GroupIdentity(replica, model, group_size).to_data()


@pytest.mark.parametrize(
    ("quorum", "me", "expected"),
    [
        # consistent
        (_members(("ft_0:u1", _ident("ft_0")), ("ft_1:u2", _ident("ft_1"))), "ft_1:u2", None),
        # a model mismatch, from either side (names are the configured ids)
        (
            _members(("ft_0:u1", _ident("ft_0")), ("ft_1:u2", _ident("ft_1", FP_B))),
            "ft_1:u2",
            f"replica group 'ft_1' runs a different model than 'ft_0' (fingerprint {FP_B} vs "
            f"{FP_A}); start every group with the same model config",
        ),
        # the same configured id twice
        (
            _members(("ft_0:u1", _ident("ft_0")), ("ft_0:u2", _ident("ft_0"))),
            "ft_0:u2",
            "replica_id 'ft_0' is already used by a live replica group; give each group a "
            "distinct --fault_tolerance.replica_id (Manager replica_id / REPLICA_GROUP_ID)",
        ),
        # a different planned number of groups
        (
            _members(("ft_0:u1", _ident("ft_0")), ("ft_1:u2", _ident("ft_1", group_size=3))),
            "ft_1:u2",
            "replica group 'ft_1' expects group_size=3 but 'ft_0' expects 2; give every group "
            "the same --fault_tolerance.group_size",
        ),
        # unknown values are not compared
        (
            _members(("a:u1", _ident("a", None, None)), ("b:u2", _ident("b", FP_B, 3))),
            "b:u2",
            None,
        ),
        # no configured id (uuid only): never a duplicate
        (_members(("u1", _ident("")), ("u2", _ident(""))), "u2", None),
        # a torchft member (no identity) is not checked, nor is a member without one
        (_members(("ft_0:u1", None), ("ft_1:u2", _ident("ft_1", FP_B))), "ft_1:u2", None),
        (_members(("ft_0:u1", _ident("ft_0")), ("ft_1:u2", None)), "ft_1:u2", None),
        # alone
        (_members(("ft_0:u1", _ident("ft_0"))), "ft_0:u1", None),
    ],
)
def test_identity_conflict(quorum: Quorum, me: str, expected: str | None) -> None:
    conflict = identity_conflict(me, quorum)
    assert conflict == expected
    assert conflict is None or "\n" not in conflict


def test_model_fingerprint() -> None:
    torch.manual_seed(0)
    first = model_fingerprint(torch.nn.Linear(1000, 2000))
    torch.manual_seed(1)  # other values, same architecture
    assert model_fingerprint(torch.nn.Linear(1000, 2000)) == first
    assert first.endswith(": 2 params / 2.0M elements") and len(first.split(":")[0]) == 8
    with torch.device("meta"):  # no memory needed
        assert model_fingerprint([torch.nn.Linear(1000, 2000)]) == first
        assert model_fingerprint(torch.nn.Linear(1000, 2001)) != first
        assert model_fingerprint(torch.nn.Linear(1000, 2000, dtype=torch.float64)) != first
