"""The committed protobuf stubs match torchft.proto, and the wire names match torchft 0.2.0's
and torchft-nightly 2026.10.26's (its reconfigure handles)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from torchtitan_ft.proto import torchft_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ["torchft_pb2.py", "torchft_pb2_grpc.py", "torchft_pb2.pyi"]


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    subprocess.run([str(ROOT / "scripts/gen_proto.sh"), str(tmp_path)], check=True)
    for name in GENERATED:
        fresh = (tmp_path / "torchtitan_ft/proto" / name).read_text()
        committed = (ROOT / "torchtitan_ft/proto" / name).read_text()
        assert fresh == committed, f"{name} is stale: run scripts/gen_proto.sh"


def test_services_and_field_numbers_match_the_wire_protocol() -> None:
    services = pb.DESCRIPTOR.services_by_name
    assert pb.DESCRIPTOR.package == "torchft"
    assert set(services["LighthouseService"].methods_by_name) >= {"Quorum", "Heartbeat"}
    assert set(services["ManagerService"].methods_by_name) == {
        "Quorum",
        "CheckpointMetadata",
        "ShouldCommit",
        "Kill",
    }
    fields = {
        name: {f.name: f.number for f in pb.DESCRIPTOR.message_types_by_name[name].fields}
        for name in ["QuorumMember", "Quorum", "ManagerQuorumRequest", "ManagerQuorumResponse"]
    }
    assert fields["QuorumMember"] == {
        "replica_id": 1,
        "address": 2,
        "store_address": 3,
        "step": 4,
        "world_size": 5,
        "shrink_only": 6,
        "data": 7,
        "commit_failures": 8,
        "reconfigure_handles": 9,  # torchft-nightly 2026.10.26
    }
    assert fields["Quorum"] == {"quorum_id": 1, "participants": 2, "created": 3}
    assert fields["ManagerQuorumRequest"] == {
        "group_rank": 1,
        "step": 2,
        "checkpoint_metadata": 3,
        "shrink_only": 4,
        "init_sync": 5,
        "commit_failures": 6,
        "reconfigure_handle": 7,  # torchft-nightly 2026.10.26
        "progress": 16,  # torchtitan_ft extension (straggler report)
    }
    assert fields["ManagerQuorumResponse"] == {
        "quorum_id": 1,
        "recover_src_manager_address": 2,
        "recover_src_replica_rank": 3,
        "recover_dst_replica_ranks": 4,
        "store_address": 5,
        "max_step": 6,
        "max_replica_rank": 7,
        "max_world_size": 8,
        "replica_rank": 9,
        "replica_world_size": 10,
        "heal": 11,
        "commit_failures": 12,
        "replica_ids": 13,
        "reconfigure_handles": 14,  # torchft-nightly 2026.10.26
        "speed": 16,  # torchtitan_ft extension (straggler report)
        "state_loss": 20,  # torchtitan_ft extension (state loss)
    }
