"""PGTransport over a real 2-process gloo group on 127.0.0.1 (this process is the donor)."""

import multiprocessing as mp
import os
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.checkpoint.state_dicts import assert_bitwise_equal, mixed_state_dict
from torchtitan_ft.checkpoint import CheckpointTransferError, PGTransport
from torchtitan_ft.process_group.base import FailedWork

TIMEOUT = timedelta(seconds=30)


def _group(rank: int, store_path: str) -> dist.ProcessGroup:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only
    return dist.ProcessGroupGloo(dist.FileStore(store_path, 2), rank, 2, TIMEOUT)


def _receiver(store_path: str, results: "mp.Queue[str]") -> None:
    try:
        transport: PGTransport = PGTransport(_group(1, store_path), TIMEOUT, torch.device("cpu"))
        got = transport.recv_checkpoint(0, "<n/a>", 12, TIMEOUT)
        assert_bitwise_equal(got, mixed_state_dict(seed=3))
        # A mismatched step is an error, and the stream stays in sync afterwards.
        try:
            transport.recv_checkpoint(0, "<n/a>", 99, TIMEOUT)
            raise AssertionError("expected CheckpointTransferError")
        except CheckpointTransferError as e:
            assert "sent step 13, requested step 99" in str(e), e
        assert torch.equal(transport.recv_checkpoint(0, "", 14, TIMEOUT)["w"], torch.zeros(2))
        results.put("ok")
    except BaseException:
        results.put(traceback.format_exc())


@pytest.mark.multiprocess
def test_round_trip_over_gloo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    store_path = str(tmp_path / "store")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    receiver = ctx.Process(target=_receiver, args=(store_path, results))
    receiver.start()
    try:
        transport: PGTransport = PGTransport(_group(0, store_path), TIMEOUT, torch.device("cpu"))
        assert transport.metadata() == "<n/a>"
        transport.send_checkpoint([1], 12, mixed_state_dict(seed=3), TIMEOUT)
        transport.send_checkpoint([1], 13, {"w": torch.ones(3)}, TIMEOUT)
        transport.send_checkpoint([1], 14, {"w": torch.zeros(2)}, TIMEOUT)
        assert results.get(timeout=60) == "ok"
    finally:
        receiver.join(timeout=10)
        if receiver.is_alive():
            receiver.kill()


class _SilentPeer:
    """A process group whose peer never answers: every send and recv times out (the real
    ProcessGroupGloo's timeout is tested in tests/process_group)."""

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> FailedWork:
        return FailedWork(TimeoutError("torchft-gloo send did not complete within 0:00:00.2"))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> FailedWork:
        return FailedWork(TimeoutError("torchft-gloo recv did not complete within 0:00:00.2"))


def test_a_silent_peer_is_a_transfer_error_that_says_timed_out() -> None:
    transport: PGTransport = PGTransport(_SilentPeer(), TIMEOUT, torch.device("cpu"))  # type: ignore[arg-type]
    short = timedelta(milliseconds=200)
    with pytest.raises(CheckpointTransferError, match=r"from rank 1 timed out after 0:00:00.2"):
        transport.recv_checkpoint(1, "<n/a>", 3, short)
    with pytest.raises(CheckpointTransferError, match=r"to rank 1 timed out after 0:00:00.2"):
        transport.send_checkpoint([1], 3, {"w": torch.ones(2)}, short)


class _TimedOutWork(dist.Work):
    """A send or recv of a silent peer: records the timeout it was waited with, then times
    out."""

    def __init__(self, waits: list[timedelta | None]) -> None:
        super().__init__()
        self._waits = waits

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._waits.append(timeout)
        raise TimeoutError("the peer did not answer")


class _RecordingSilentPeer:
    def __init__(self) -> None:
        self.waits: list[timedelta | None] = []

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
        return _TimedOutWork(self.waits)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
        return _TimedOutWork(self.waits)


@pytest.mark.parametrize(
    ("given", "expected"),
    [("omitted", TIMEOUT), (None, TIMEOUT), (timedelta(seconds=2), timedelta(seconds=2))],
)
def test_a_call_without_a_timeout_of_its_own_waits_with_the_transport_s(
    given: object, expected: timedelta
) -> None:
    # torchft-nightly's signature: send_checkpoint / recv_checkpoint's timeout is optional.
    peer = _RecordingSilentPeer()
    transport: PGTransport = PGTransport(peer, TIMEOUT, torch.device("cpu"))  # type: ignore[arg-type]
    kwargs = {} if given == "omitted" else {"timeout": given}
    with pytest.raises(CheckpointTransferError, match="timed out"):
        transport.recv_checkpoint(1, "<n/a>", 3, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(CheckpointTransferError, match="timed out"):
        transport.send_checkpoint([1], 3, {"w": torch.ones(2)}, **kwargs)  # type: ignore[arg-type]
    assert peer.waits == [expected, expected]
