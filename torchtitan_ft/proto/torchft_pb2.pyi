import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class QuorumMember(_message.Message):
    __slots__ = ("replica_id", "address", "store_address", "step", "world_size", "shrink_only", "data", "commit_failures", "reconfigure_handles")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHRINK_ONLY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FAILURES_FIELD_NUMBER: _ClassVar[int]
    RECONFIGURE_HANDLES_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    store_address: str
    step: int
    world_size: int
    shrink_only: bool
    data: str
    commit_failures: int
    reconfigure_handles: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., store_address: _Optional[str] = ..., step: _Optional[int] = ..., world_size: _Optional[int] = ..., shrink_only: _Optional[bool] = ..., data: _Optional[str] = ..., commit_failures: _Optional[int] = ..., reconfigure_handles: _Optional[_Iterable[str]] = ...) -> None: ...

class Quorum(_message.Message):
    __slots__ = ("quorum_id", "participants", "created")
    QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    quorum_id: int
    participants: _containers.RepeatedCompositeFieldContainer[QuorumMember]
    created: _timestamp_pb2.Timestamp
    def __init__(self, quorum_id: _Optional[int] = ..., participants: _Optional[_Iterable[_Union[QuorumMember, _Mapping]]] = ..., created: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class StepTiming(_message.Message):
    __slots__ = ("step", "step_seconds", "compute_seconds")
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    step: int
    step_seconds: float
    compute_seconds: float
    def __init__(self, step: _Optional[int] = ..., step_seconds: _Optional[float] = ..., compute_seconds: _Optional[float] = ...) -> None: ...

class GroupProgress(_message.Message):
    __slots__ = ("steps", "batches_committed", "discarded_steps", "heals", "samples_committed", "link_probes", "recoveries", "launcher_job")
    STEPS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    DISCARDED_STEPS_FIELD_NUMBER: _ClassVar[int]
    HEALS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    LINK_PROBES_FIELD_NUMBER: _ClassVar[int]
    RECOVERIES_FIELD_NUMBER: _ClassVar[int]
    LAUNCHER_JOB_FIELD_NUMBER: _ClassVar[int]
    steps: _containers.RepeatedCompositeFieldContainer[StepTiming]
    batches_committed: int
    discarded_steps: int
    heals: _containers.RepeatedCompositeFieldContainer[HealReport]
    samples_committed: int
    link_probes: _containers.RepeatedCompositeFieldContainer[LinkProbeResult]
    recoveries: _containers.RepeatedCompositeFieldContainer[RecoveryReport]
    launcher_job: str
    def __init__(self, steps: _Optional[_Iterable[_Union[StepTiming, _Mapping]]] = ..., batches_committed: _Optional[int] = ..., discarded_steps: _Optional[int] = ..., heals: _Optional[_Iterable[_Union[HealReport, _Mapping]]] = ..., samples_committed: _Optional[int] = ..., link_probes: _Optional[_Iterable[_Union[LinkProbeResult, _Mapping]]] = ..., recoveries: _Optional[_Iterable[_Union[RecoveryReport, _Mapping]]] = ..., launcher_job: _Optional[str] = ...) -> None: ...

class RecoveryReport(_message.Message):
    __slots__ = ("kind", "process_started", "manager_built", "quorum_asked", "quorum_received", "healed", "first_commit", "heal_to_step", "donor_replica_rank", "donor_address", "heal_path", "heal_outcome", "heal_seconds", "heal_bytes")
    KIND_FIELD_NUMBER: _ClassVar[int]
    PROCESS_STARTED_FIELD_NUMBER: _ClassVar[int]
    MANAGER_BUILT_FIELD_NUMBER: _ClassVar[int]
    QUORUM_ASKED_FIELD_NUMBER: _ClassVar[int]
    QUORUM_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    HEALED_FIELD_NUMBER: _ClassVar[int]
    FIRST_COMMIT_FIELD_NUMBER: _ClassVar[int]
    HEAL_TO_STEP_FIELD_NUMBER: _ClassVar[int]
    DONOR_REPLICA_RANK_FIELD_NUMBER: _ClassVar[int]
    DONOR_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEAL_PATH_FIELD_NUMBER: _ClassVar[int]
    HEAL_OUTCOME_FIELD_NUMBER: _ClassVar[int]
    HEAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HEAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    kind: str
    process_started: float
    manager_built: float
    quorum_asked: float
    quorum_received: float
    healed: float
    first_commit: float
    heal_to_step: int
    donor_replica_rank: int
    donor_address: str
    heal_path: str
    heal_outcome: str
    heal_seconds: float
    heal_bytes: int
    def __init__(self, kind: _Optional[str] = ..., process_started: _Optional[float] = ..., manager_built: _Optional[float] = ..., quorum_asked: _Optional[float] = ..., quorum_received: _Optional[float] = ..., healed: _Optional[float] = ..., first_commit: _Optional[float] = ..., heal_to_step: _Optional[int] = ..., donor_replica_rank: _Optional[int] = ..., donor_address: _Optional[str] = ..., heal_path: _Optional[str] = ..., heal_outcome: _Optional[str] = ..., heal_seconds: _Optional[float] = ..., heal_bytes: _Optional[int] = ...) -> None: ...

class LinkProbeResult(_message.Message):
    __slots__ = ("seq", "bytes", "seconds")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    bytes: int
    seconds: float
    def __init__(self, seq: _Optional[int] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class LinkProbeRequest(_message.Message):
    __slots__ = ("replica_id", "payload")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    payload: bytes
    def __init__(self, replica_id: _Optional[str] = ..., payload: _Optional[bytes] = ...) -> None: ...

class LinkProbeResponse(_message.Message):
    __slots__ = ("payload", "probe_bytes", "interval_ms")
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    PROBE_BYTES_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    payload: bytes
    probe_bytes: int
    interval_ms: int
    def __init__(self, payload: _Optional[bytes] = ..., probe_bytes: _Optional[int] = ..., interval_ms: _Optional[int] = ...) -> None: ...

class HealReport(_message.Message):
    __slots__ = ("to_step", "source_address", "bytes", "seconds", "outcome", "started")
    TO_STEP_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    to_step: int
    source_address: str
    bytes: int
    seconds: float
    outcome: str
    started: float
    def __init__(self, to_step: _Optional[int] = ..., source_address: _Optional[str] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., outcome: _Optional[str] = ..., started: _Optional[float] = ...) -> None: ...

class GroupSpeed(_message.Message):
    __slots__ = ("replica_id", "relative_speed", "straggler", "straggler_since_step", "excluded", "link_relative_speed", "straggler_cause")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    RELATIVE_SPEED_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_SINCE_STEP_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    LINK_RELATIVE_SPEED_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_CAUSE_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    relative_speed: float
    straggler: bool
    straggler_since_step: int
    excluded: bool
    link_relative_speed: float
    straggler_cause: str
    def __init__(self, replica_id: _Optional[str] = ..., relative_speed: _Optional[float] = ..., straggler: _Optional[bool] = ..., straggler_since_step: _Optional[int] = ..., excluded: _Optional[bool] = ..., link_relative_speed: _Optional[float] = ..., straggler_cause: _Optional[str] = ...) -> None: ...

class LighthouseQuorumRequest(_message.Message):
    __slots__ = ("requester", "progress")
    REQUESTER_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    requester: QuorumMember
    progress: GroupProgress
    def __init__(self, requester: _Optional[_Union[QuorumMember, _Mapping]] = ..., progress: _Optional[_Union[GroupProgress, _Mapping]] = ...) -> None: ...

class LighthouseQuorumResponse(_message.Message):
    __slots__ = ("quorum", "speeds", "state_loss")
    QUORUM_FIELD_NUMBER: _ClassVar[int]
    SPEEDS_FIELD_NUMBER: _ClassVar[int]
    STATE_LOSS_FIELD_NUMBER: _ClassVar[int]
    quorum: Quorum
    speeds: _containers.RepeatedCompositeFieldContainer[GroupSpeed]
    state_loss: StateLoss
    def __init__(self, quorum: _Optional[_Union[Quorum, _Mapping]] = ..., speeds: _Optional[_Iterable[_Union[GroupSpeed, _Mapping]]] = ..., state_loss: _Optional[_Union[StateLoss, _Mapping]] = ...) -> None: ...

class StateLoss(_message.Message):
    __slots__ = ("lost_step", "holders")
    LOST_STEP_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    lost_step: int
    holders: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lost_step: _Optional[int] = ..., holders: _Optional[_Iterable[str]] = ...) -> None: ...

class LighthouseHeartbeatRequest(_message.Message):
    __slots__ = ("replica_id", "group_rank", "goodbye")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_RANK_FIELD_NUMBER: _ClassVar[int]
    GOODBYE_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    group_rank: int
    goodbye: bool
    def __init__(self, replica_id: _Optional[str] = ..., group_rank: _Optional[int] = ..., goodbye: _Optional[bool] = ...) -> None: ...

class LighthouseHeartbeatResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LighthouseGoneRequest(_message.Message):
    __slots__ = ("replica_id", "members", "wait_ms")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    members: _containers.RepeatedScalarFieldContainer[str]
    wait_ms: int
    def __init__(self, replica_id: _Optional[str] = ..., members: _Optional[_Iterable[str]] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class LighthouseGoneResponse(_message.Message):
    __slots__ = ("gone", "requester_gone", "heartbeat_timeout_ms")
    GONE_FIELD_NUMBER: _ClassVar[int]
    REQUESTER_GONE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    gone: _containers.RepeatedScalarFieldContainer[str]
    requester_gone: bool
    heartbeat_timeout_ms: int
    def __init__(self, gone: _Optional[_Iterable[str]] = ..., requester_gone: _Optional[bool] = ..., heartbeat_timeout_ms: _Optional[int] = ...) -> None: ...

class ManagerQuorumRequest(_message.Message):
    __slots__ = ("group_rank", "step", "checkpoint_metadata", "shrink_only", "init_sync", "commit_failures", "reconfigure_handle", "progress")
    GROUP_RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_METADATA_FIELD_NUMBER: _ClassVar[int]
    SHRINK_ONLY_FIELD_NUMBER: _ClassVar[int]
    INIT_SYNC_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FAILURES_FIELD_NUMBER: _ClassVar[int]
    RECONFIGURE_HANDLE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    group_rank: int
    step: int
    checkpoint_metadata: str
    shrink_only: bool
    init_sync: bool
    commit_failures: int
    reconfigure_handle: str
    progress: GroupProgress
    def __init__(self, group_rank: _Optional[int] = ..., step: _Optional[int] = ..., checkpoint_metadata: _Optional[str] = ..., shrink_only: _Optional[bool] = ..., init_sync: _Optional[bool] = ..., commit_failures: _Optional[int] = ..., reconfigure_handle: _Optional[str] = ..., progress: _Optional[_Union[GroupProgress, _Mapping]] = ...) -> None: ...

class ManagerQuorumResponse(_message.Message):
    __slots__ = ("quorum_id", "recover_src_manager_address", "recover_src_replica_rank", "recover_dst_replica_ranks", "store_address", "max_step", "max_replica_rank", "max_world_size", "replica_rank", "replica_world_size", "heal", "commit_failures", "replica_ids", "reconfigure_handles", "speed", "state_loss")
    QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    RECOVER_SRC_MANAGER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RECOVER_SRC_REPLICA_RANK_FIELD_NUMBER: _ClassVar[int]
    RECOVER_DST_REPLICA_RANKS_FIELD_NUMBER: _ClassVar[int]
    STORE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MAX_STEP_FIELD_NUMBER: _ClassVar[int]
    MAX_REPLICA_RANK_FIELD_NUMBER: _ClassVar[int]
    MAX_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_RANK_FIELD_NUMBER: _ClassVar[int]
    REPLICA_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    HEAL_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FAILURES_FIELD_NUMBER: _ClassVar[int]
    REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    RECONFIGURE_HANDLES_FIELD_NUMBER: _ClassVar[int]
    SPEED_FIELD_NUMBER: _ClassVar[int]
    STATE_LOSS_FIELD_NUMBER: _ClassVar[int]
    quorum_id: int
    recover_src_manager_address: str
    recover_src_replica_rank: int
    recover_dst_replica_ranks: _containers.RepeatedScalarFieldContainer[int]
    store_address: str
    max_step: int
    max_replica_rank: int
    max_world_size: int
    replica_rank: int
    replica_world_size: int
    heal: bool
    commit_failures: int
    replica_ids: _containers.RepeatedScalarFieldContainer[str]
    reconfigure_handles: _containers.RepeatedScalarFieldContainer[str]
    speed: GroupSpeed
    state_loss: StateLoss
    def __init__(self, quorum_id: _Optional[int] = ..., recover_src_manager_address: _Optional[str] = ..., recover_src_replica_rank: _Optional[int] = ..., recover_dst_replica_ranks: _Optional[_Iterable[int]] = ..., store_address: _Optional[str] = ..., max_step: _Optional[int] = ..., max_replica_rank: _Optional[int] = ..., max_world_size: _Optional[int] = ..., replica_rank: _Optional[int] = ..., replica_world_size: _Optional[int] = ..., heal: _Optional[bool] = ..., commit_failures: _Optional[int] = ..., replica_ids: _Optional[_Iterable[str]] = ..., reconfigure_handles: _Optional[_Iterable[str]] = ..., speed: _Optional[_Union[GroupSpeed, _Mapping]] = ..., state_loss: _Optional[_Union[StateLoss, _Mapping]] = ...) -> None: ...

class CheckpointMetadataRequest(_message.Message):
    __slots__ = ("rank",)
    RANK_FIELD_NUMBER: _ClassVar[int]
    rank: int
    def __init__(self, rank: _Optional[int] = ...) -> None: ...

class CheckpointMetadataResponse(_message.Message):
    __slots__ = ("checkpoint_metadata",)
    CHECKPOINT_METADATA_FIELD_NUMBER: _ClassVar[int]
    checkpoint_metadata: str
    def __init__(self, checkpoint_metadata: _Optional[str] = ...) -> None: ...

class ShouldCommitRequest(_message.Message):
    __slots__ = ("should_commit", "group_rank", "step")
    SHOULD_COMMIT_FIELD_NUMBER: _ClassVar[int]
    GROUP_RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    should_commit: bool
    group_rank: int
    step: int
    def __init__(self, should_commit: _Optional[bool] = ..., group_rank: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...

class ShouldCommitResponse(_message.Message):
    __slots__ = ("should_commit",)
    SHOULD_COMMIT_FIELD_NUMBER: _ClassVar[int]
    should_commit: bool
    def __init__(self, should_commit: _Optional[bool] = ...) -> None: ...

class KillRequest(_message.Message):
    __slots__ = ("msg",)
    MSG_FIELD_NUMBER: _ClassVar[int]
    msg: str
    def __init__(self, msg: _Optional[str] = ...) -> None: ...

class KillResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
