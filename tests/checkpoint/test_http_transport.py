"""HTTPTransport against real HTTP servers on 127.0.0.1 (and a real donor process to kill)."""

import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from urllib.parse import parse_qs, urlsplit

import pytest
import torch

from tests.checkpoint.state_dicts import assert_bitwise_equal, mixed_state_dict
from torchtitan_ft.checkpoint import CheckpointTransferError, HTTPTransport, _http_client
from torchtitan_ft.checkpoint.paths import PathUsed

TIMEOUT = timedelta(seconds=10)


@pytest.fixture
def donor() -> Iterator[HTTPTransport]:
    t: HTTPTransport = HTTPTransport(TIMEOUT, num_chunks=0, hostname="127.0.0.1")
    yield t
    t.shutdown()


@pytest.fixture
def receiver() -> Iterator[HTTPTransport]:
    t: HTTPTransport = HTTPTransport(TIMEOUT, num_chunks=3, hostname="127.0.0.1")
    yield t
    t.shutdown()


def get(
    transport: HTTPTransport, path: str, headers: dict[str, str] | None = None
) -> tuple[int, bytes, http.client.HTTPResponse]:
    """A raw GET against the transport's server; path is relative to the host."""
    url = urlsplit(transport.metadata())
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=5)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read(), resp
    finally:
        conn.close()


def base(transport: HTTPTransport) -> str:
    return urlsplit(transport.metadata()).path


def test_metadata_advertises_hostname_and_binds_it(donor: HTTPTransport) -> None:
    url = urlsplit(donor.metadata())
    assert (url.scheme, url.hostname, url.path) == ("http", "127.0.0.1", "/checkpoint")
    assert donor._server.address[0] == "127.0.0.1"


@pytest.mark.parametrize("num_chunks", [0, 3])
def test_round_trip_is_bitwise_equal(donor: HTTPTransport, num_chunks: int) -> None:
    state = mixed_state_dict()
    donor.send_checkpoint([1], 12, state, TIMEOUT)
    rx: HTTPTransport = HTTPTransport(TIMEOUT, num_chunks=num_chunks, hostname="127.0.0.1")
    try:
        got = rx.recv_checkpoint(0, donor.metadata(), 12, TIMEOUT)
    finally:
        rx.shutdown()
    assert_bitwise_equal(got, state)
    # Received tensors are independent, writable, ordinary tensors.
    got["model"]["w"].add_(1)
    assert not torch.equal(got["model"]["w"], state["model"]["w"])


@pytest.mark.parametrize("num_chunks", [0, 3])
def test_borrowed_receives_reuse_one_buffer(donor: HTTPTransport, num_chunks: int) -> None:
    rx: HTTPTransport = HTTPTransport(TIMEOUT, num_chunks=num_chunks, hostname="127.0.0.1")
    try:
        first = mixed_state_dict(seed=1)
        donor.send_checkpoint([1], 1, first, TIMEOUT)
        got = rx.recv_checkpoint_borrowed(0, donor.metadata(), 1, TIMEOUT)
        assert_bitwise_equal(got, first)  # mixed dtypes at odd byte offsets, laid out aligned
        ptr, held = got["model"]["w"].data_ptr(), rx._receive_buffer.nbytes
        assert held >= sum(t.numel() * t.element_size() for t in first["model"].values())

        second = mixed_state_dict(seed=2)
        donor.disallow_checkpoint()
        donor.send_checkpoint([1], 2, second, TIMEOUT)
        again = rx.recv_checkpoint_borrowed(0, donor.metadata(), 2, TIMEOUT)
        assert_bitwise_equal(again, second)
        assert again["model"]["w"].data_ptr() == ptr and rx._receive_buffer.nbytes == held
        assert torch.equal(got["model"]["w"], second["model"]["w"])  # overwritten: borrowed

        bigger = {"w": torch.randn(held)}  # does not fit: the buffer grows
        donor.disallow_checkpoint()
        donor.send_checkpoint([1], 3, bigger, TIMEOUT)
        assert_bitwise_equal(rx.recv_checkpoint_borrowed(0, donor.metadata(), 3, TIMEOUT), bigger)
        assert rx._receive_buffer.nbytes >= 4 * held
    finally:
        rx.shutdown()


def test_without_reuse_borrowed_receives_get_new_tensors(donor: HTTPTransport) -> None:
    rx: HTTPTransport = HTTPTransport(
        TIMEOUT, num_chunks=0, hostname="127.0.0.1", reuse_receive_buffer=False
    )
    try:
        state = {"w": torch.randn(1000)}
        donor.send_checkpoint([1], 1, state, TIMEOUT)
        got = rx.recv_checkpoint_borrowed(0, donor.metadata(), 1, TIMEOUT)
        again = rx.recv_checkpoint_borrowed(0, donor.metadata(), 1, TIMEOUT)
        assert_bitwise_equal(got, state)
        got["w"].add_(1.0)
        assert_bitwise_equal(again, state)  # independent tensors
        assert rx._receive_buffer is None
    finally:
        rx.shutdown()


def test_receiver_gets_the_snapshot_not_later_mutations(
    donor: HTTPTransport, receiver: HTTPTransport
) -> None:
    state = {"w": torch.randn(1 << 20), "b": torch.zeros(100)}
    expected = {k: v.clone() for k, v in state.items()}
    donor.send_checkpoint([1], 3, state, TIMEOUT)
    state["w"].add_(1.0)  # the donor trains on in place
    state["b"].fill_(7.0)
    got = receiver.recv_checkpoint(0, donor.metadata(), 3, TIMEOUT)
    assert_bitwise_equal(got, expected)


def test_wrong_step_is_refused_and_the_server_keeps_serving(
    donor: HTTPTransport, receiver: HTTPTransport
) -> None:
    donor.send_checkpoint([1], 5, {"w": torch.ones(4)}, TIMEOUT)
    status, body, _ = get(donor, f"{base(donor)}/4/header")
    assert status == 400
    assert b"offering step 5, requested step 4" in body
    # A newer step may still be staged: retried until the receiver's timeout, then an error.
    with pytest.raises(CheckpointTransferError, match=r"timed out.*503.*not offering step 6 yet"):
        receiver.recv_checkpoint(0, donor.metadata(), 6, timedelta(milliseconds=300))
    got = receiver.recv_checkpoint(0, donor.metadata(), 5, TIMEOUT)
    assert torch.equal(got["w"], torch.ones(4))


def test_receiver_that_asks_before_the_donor_stages_waits_for_it(
    donor: HTTPTransport, receiver: HTTPTransport
) -> None:
    """The healer's quorum thread can reach the donor before the donor's has staged."""
    result: list[dict] = []
    fetch = threading.Thread(
        target=lambda: result.append(receiver.recv_checkpoint(0, donor.metadata(), 2, TIMEOUT))
    )
    fetch.start()
    time.sleep(0.3)
    assert not result
    donor.send_checkpoint([1], 2, {"w": torch.arange(6.0)}, TIMEOUT)
    fetch.join(timeout=10)
    assert torch.equal(result[0]["w"], torch.arange(6.0))


def test_unknown_paths_and_bad_ranges(donor: HTTPTransport, receiver: HTTPTransport) -> None:
    donor.send_checkpoint([1], 1, {"w": torch.ones(4)}, TIMEOUT)
    for path in ("/", "/other", f"{base(donor)}/x/header", f"{base(donor)}/1/weights"):
        assert get(donor, path)[0] == 404, path
    status, body, resp = get(donor, f"{base(donor)}/1/header")
    header = json.loads(body)
    lease = resp.getheader("X-Checkpoint-Lease")
    data = f"{base(donor)}/1/data?snapshot={header['snapshot_id']}&lease={lease}"
    assert get(donor, data, {"Range": "bytes=0-16"})[0] == 416  # 16 bytes: 0..15
    assert get(donor, data, {"Range": "lines=1-2"})[0] == 416
    assert get(donor, f"{base(donor)}/1/data?snapshot=nope&lease={lease}")[0] == 410
    assert get(donor, f"{base(donor)}/1/data?snapshot={header['snapshot_id']}")[0] == 410
    status, body, _ = get(donor, data, {"Range": "bytes=4-7"})
    assert (status, body) == (206, torch.ones(1).numpy().tobytes())
    assert torch.equal(
        receiver.recv_checkpoint(0, donor.metadata(), 1, TIMEOUT)["w"], torch.ones(4)
    )


def test_auth_token_required() -> None:
    donor: HTTPTransport = HTTPTransport(TIMEOUT, 0, hostname="127.0.0.1", auth_token="s3cret")
    good: HTTPTransport = HTTPTransport(TIMEOUT, 2, hostname="127.0.0.1", auth_token="s3cret")
    bad: HTTPTransport = HTTPTransport(TIMEOUT, 2, hostname="127.0.0.1", auth_token="guess")
    none: HTTPTransport = HTTPTransport(TIMEOUT, 2, hostname="127.0.0.1")
    try:
        donor.send_checkpoint([1], 2, {"w": torch.arange(10)}, TIMEOUT)
        path = f"{base(donor)}/2/header"
        assert get(donor, path)[0] == 401
        assert get(donor, path, {"Authorization": "Bearer guess"})[0] == 401
        assert get(donor, "/other")[0] == 401  # nothing is revealed without the token
        status, _, _ = get(donor, path, {"Authorization": "Bearer s3cret"})
        assert status == 200
        for rx in (bad, none):
            with pytest.raises(CheckpointTransferError, match="401"):
                rx.recv_checkpoint(0, donor.metadata(), 2, TIMEOUT)
        got = good.recv_checkpoint(0, donor.metadata(), 2, TIMEOUT)
        assert torch.equal(got["w"], torch.arange(10))
    finally:
        for t in (donor, good, bad, none):
            t.shutdown()


def test_disallow_refuses_new_receivers_but_lets_leased_ones_finish(
    donor: HTTPTransport, receiver: HTTPTransport
) -> None:
    donor.send_checkpoint([1], 8, {"w": torch.full((1000,), 2.0)}, TIMEOUT)
    status, body, resp = get(donor, f"{base(donor)}/8/header")
    assert status == 200
    header, lease = json.loads(body), resp.getheader("X-Checkpoint-Lease")
    donor.disallow_checkpoint()
    status, body, _ = get(donor, f"{base(donor)}/8/header")
    assert status == 503 and b"not offering step 8 yet (offering nothing)" in body
    with pytest.raises(CheckpointTransferError, match=r"503.*not offering step 8 yet"):
        # It retries the 503 until its deadline, then names it; 300 ms once passed before
        # the first answer arrived under load ("transfer deadline passed").
        receiver.recv_checkpoint(0, donor.metadata(), 8, timedelta(seconds=2))
    # The receiver that got the header before disallow may still fetch the bytes.
    status, body, _ = get(
        donor, f"{base(donor)}/8/data?snapshot={header['snapshot_id']}&lease={lease}"
    )
    assert status == 206 and body == torch.full((1000,), 2.0).numpy().tobytes()
    # Once it has everything the snapshot is gone (retired by the serving thread right after
    # the response went out).
    deadline = time.monotonic() + 5
    while (
        status := get(
            donor, f"{base(donor)}/8/data?snapshot={header['snapshot_id']}&lease={lease}"
        )[0]
    ) != 410 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert status == 410


def test_leased_snapshot_survives_the_next_send(donor: HTTPTransport) -> None:
    donor.send_checkpoint([1], 1, {"w": torch.full((256,), 1.0)}, TIMEOUT)
    _, body, resp = get(donor, f"{base(donor)}/1/header")
    old, lease = json.loads(body), resp.getheader("X-Checkpoint-Lease")
    donor.send_checkpoint([1], 2, {"w": torch.full((256,), 2.0)}, TIMEOUT)
    status, data, _ = get(
        donor, f"{base(donor)}/1/data?snapshot={old['snapshot_id']}&lease={lease}"
    )
    assert status == 206 and data == torch.full((256,), 1.0).numpy().tobytes()
    rx: HTTPTransport = HTTPTransport(TIMEOUT, 0, hostname="127.0.0.1")
    try:
        assert torch.equal(
            rx.recv_checkpoint(0, donor.metadata(), 2, TIMEOUT)["w"], torch.full((256,), 2.0)
        )
    finally:
        rx.shutdown()


def test_staging_buffer_is_reused_when_no_one_reads_it(donor: HTTPTransport) -> None:
    donor.send_checkpoint([1], 1, {"w": torch.ones(1000)}, TIMEOUT)
    first = donor._server.store._offered.staging
    donor.disallow_checkpoint()
    donor.send_checkpoint([1], 2, {"w": torch.ones(10)}, TIMEOUT)
    assert donor._server.store._offered.staging is first


def test_unreachable_or_silent_donor_raises(receiver: HTTPTransport) -> None:
    silent = socket.create_server(("127.0.0.1", 0))  # accepts connections, never answers
    try:
        port = silent.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(CheckpointTransferError, match=r"rank 4.*timed out"):
            receiver.recv_checkpoint(
                4, f"http://127.0.0.1:{port}/checkpoint", 1, timedelta(seconds=0.5)
            )
        assert time.monotonic() - started < 3
    finally:
        silent.close()
    with pytest.raises(CheckpointTransferError, match="Connection refused"):
        receiver.recv_checkpoint(0, f"http://127.0.0.1:{port}/checkpoint", 1, TIMEOUT)
    with pytest.raises(CheckpointTransferError, match="not an http://host:port"):
        receiver.recv_checkpoint(0, "<n/a>", 1, TIMEOUT)


def test_a_heal_records_the_path_it_came_over(
    donor: HTTPTransport, receiver: HTTPTransport
) -> None:
    port = urlsplit(donor.metadata()).port
    assert parse_qs(urlsplit(donor.metadata()).query) == {"via": ["lo/127.0.0.1"]}
    donor.send_checkpoint([1], 3, {"w": torch.arange(10)}, TIMEOUT)
    assert receiver.last_path is None
    receiver.recv_checkpoint(0, donor.metadata(), 3, TIMEOUT)
    # one path: nothing to probe
    assert receiver.last_path == PathUsed(f"127.0.0.1:{port}", "lo", None, ())
    # a URL without the offer (a donor of before it): its host alone
    bare = donor.metadata().partition("?")[0]
    got = receiver.recv_checkpoint(0, bare, 3, TIMEOUT)
    assert torch.equal(got["w"], torch.arange(10))
    assert receiver.last_path == PathUsed(f"127.0.0.1:{port}", None, None, ())


def test_the_donors_paths_are_probed_and_a_dead_one_tried_last(
    donor: HTTPTransport, receiver: HTTPTransport
) -> None:
    """Two paths offered, the first (the donor's preferred) with nothing listening: the probe
    finds it refused and the heal goes over the live one at once."""
    port = urlsplit(donor.metadata()).port
    donor.send_checkpoint([1], 3, {"w": torch.arange(10)}, TIMEOUT)
    url = f"http://127.0.0.1:{port}/checkpoint?via=eth7%2F127.0.0.2&via=lo%2F127.0.0.1"
    got = receiver.recv_checkpoint(0, url, 3, TIMEOUT)
    assert torch.equal(got["w"], torch.arange(10))
    used = receiver.last_path
    assert used is not None and (used.address, used.interface) == (f"127.0.0.1:{port}", "lo")
    assert used.probe_mb_s is not None and used.probe_mb_s > 0 and used.failures == ()


def test_no_reachable_path_names_each_address_tried_and_why(receiver: HTTPTransport) -> None:
    silent = socket.create_server(("127.0.0.1", 0))  # never answers: a stalled path
    port = silent.getsockname()[1]
    stalls: HTTPTransport = HTTPTransport(
        TIMEOUT, 0, hostname="127.0.0.1", stall_timeout=timedelta(seconds=0.3)
    )
    try:
        url = f"http://127.0.0.1:{port}/checkpoint?via=eth7%2F127.0.0.3&via=lo%2F127.0.0.1"
        started = time.monotonic()
        with pytest.raises(CheckpointTransferError) as error:
            stalls.recv_checkpoint(2, url, 1, TIMEOUT)
        assert time.monotonic() - started < 5  # the stall bound, not the 10 s timeout
    finally:
        stalls.shutdown()
        silent.close()
    message = str(error.value)
    assert "no address of the donor worked" in message
    assert f"127.0.0.3:{port} (ConnectionRefusedError" in message
    assert f"127.0.0.1:{port} (TimeoutError: no byte from the donor for 0.3 s" in message


def test_the_probe_route_sends_what_was_asked(donor: HTTPTransport) -> None:
    status, body, _ = get(donor, f"{base(donor)}/probe?bytes=5000")
    assert (status, body) == (200, bytes(5000))
    for bad in ("", "-1", f"{(16 << 20) + 1}", "x"):
        status, body, _ = get(donor, f"{base(donor)}/probe?bytes={bad}")
        assert status == 400 and b"expected 0 to 16777216" in body, (bad, body)


def test_a_pinned_interface_that_does_not_exist_stops_the_transport() -> None:
    with pytest.raises(ValueError) as error:
        HTTPTransport(TIMEOUT, 0, hostname="127.0.0.1", interfaces=["ib7"])
    assert "heal interface 'ib7' does not exist on this host" in str(error.value)
    assert "\n" not in str(error.value)


def test_constructor_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="timeout"):
        HTTPTransport(timedelta(0), 0, hostname="127.0.0.1")
    with pytest.raises(ValueError, match="num_chunks"):
        HTTPTransport(TIMEOUT, -1, hostname="127.0.0.1")
    with pytest.raises(ValueError, match="auth_token"):
        HTTPTransport(TIMEOUT, 0, hostname="127.0.0.1", auth_token="")
    with pytest.raises(ValueError, match="reuse_receive_buffer must be a bool, got 'yes'"):
        HTTPTransport(TIMEOUT, 0, hostname="127.0.0.1", reuse_receive_buffer="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="interfaces must be a sequence of names, got 'ib0'"):
        HTTPTransport(TIMEOUT, 0, hostname="127.0.0.1", interfaces="ib0")
    with pytest.raises(ValueError, match="stall_timeout must be a positive timedelta"):
        HTTPTransport(TIMEOUT, 0, hostname="127.0.0.1", stall_timeout=timedelta(0))


_DONOR = """
import sys, time, torch
from datetime import timedelta
from torchtitan_ft.checkpoint import HTTPTransport
t = HTTPTransport(timedelta(seconds=30), 0, hostname="127.0.0.1")
t.send_checkpoint([1], 7, {"w": torch.ones(16 << 20)}, timedelta(seconds=30))  # 64 MB
print(t.metadata(), flush=True)
time.sleep(60)
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("num_chunks", [0, 2])
def test_donor_killed_mid_transfer(
    receiver: HTTPTransport, monkeypatch: pytest.MonkeyPatch, num_chunks: int
) -> None:
    donor = subprocess.Popen([sys.executable, "-c", _DONOR], stdout=subprocess.PIPE, text=True)
    try:
        metadata = donor.stdout.readline().strip()
        assert metadata.startswith("http://127.0.0.1:")
        real_readinto = _http_client.Response.readinto

        def read_then_kill(self, view, deadline):  # type: ignore[no-untyped-def]
            if len(view) > 1 << 20 and donor.poll() is None:
                real_readinto(self, view[: 1 << 20], deadline)  # the transfer is under way
                donor.kill()
                donor.wait()
                view = view[1 << 20 :]
            real_readinto(self, view, deadline)

        monkeypatch.setattr(_http_client.Response, "readinto", read_then_kill)
        receiver._num_chunks = num_chunks
        started = time.monotonic()
        with pytest.raises(
            CheckpointTransferError, match=r"step 7 from replica rank 0.*(closed|reset)"
        ):
            receiver.recv_checkpoint(0, metadata, 7, TIMEOUT)
        assert time.monotonic() - started < 5
        assert donor.returncode == -9
    finally:
        donor.kill()
        donor.wait()
