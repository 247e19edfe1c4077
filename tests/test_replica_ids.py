"""The replica-id format: built and parsed by one module, as a table."""

from __future__ import annotations

import pytest

from torchtitan_ft.replica_ids import (
    group_number,
    process_replica_id,
    replica_name,
    titan_replica_name,
)

UUID = "5f0c6a0e-1d2b-4c1e-9f0a-0123456789ab"


@pytest.mark.parametrize(
    ("replica_id", "name", "group"),
    [
        (f"torchtitan_ft_2:{UUID}", "torchtitan_ft_2", 2),
        ("torchtitan_ft_11", "torchtitan_ft_11", 11),
        (f"replica_3:{UUID}", "replica_3", 3),
        (f"train:{UUID}", "train", None),
        (UUID, UUID, None),  # an empty name: the uuid alone (ends in "ab")
        (f"host:7:{UUID}", "host:7", 7),  # a name with a colon keeps it
    ],
)
def test_parse(replica_id: str, name: str, group: int | None) -> None:
    assert replica_name(replica_id) == name
    assert group_number(replica_id, default=-1) == (-1 if group is None else group)


@pytest.mark.parametrize("group", [0, 1, 17])
def test_a_built_titan_id_parses_back(group: int) -> None:
    full = process_replica_id(titan_replica_name(group), UUID)
    assert full == f"torchtitan_ft_{group}:{UUID}"
    assert (replica_name(full), group_number(full)) == (titan_replica_name(group), group)


def test_an_empty_name_joins_with_the_incarnation_alone() -> None:
    assert process_replica_id("", UUID) == UUID


def test_a_name_without_a_group_number_is_refused_unless_a_default_is_given() -> None:
    with pytest.raises(ValueError, match=r"'train:x': its name 'train' ends in no group number"):
        group_number("train:x")
    assert group_number("train:x", default=0) == 0
