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
