"""The heal's choice among a donor's addresses and its fallback (``checkpoint.paths``)."""

from __future__ import annotations

import pytest

from torchtitan_ft.checkpoint.paths import Candidate, NoPathError, first_that_works, order

ETH = Candidate("10.0.0.1:80", "eth0", link_mbit_s=100)
IB = Candidate("10.1.0.1:80", "ib0", link_mbit_s=100_000)
WIFI = Candidate("10.2.0.1:80", "wlan0")


@pytest.mark.parametrize(
    ("candidates", "pinned", "expected"),
    [
        # by the kernel's link speed, whatever the donor's order (torchft #329: Ethernet first)
        ([ETH, IB], None, [IB, ETH]),
        # unknown speed last; equal keys keep the donor's order
        ([WIFI, ETH, IB], None, [IB, ETH, WIFI]),
        (
            [ETH, Candidate("10.3.0.1:80", "eth1", link_mbit_s=100)],
            None,
            [ETH, Candidate("10.3.0.1:80", "eth1", link_mbit_s=100)],
        ),
        # a measurement wins over the reported speed
        (
            [
                Candidate("a:1", "ib0", 100_000, probe_mb_s=12.0),
                Candidate("b:1", "eth0", 100, 90.0),
            ],
            None,
            [Candidate("b:1", "eth0", 100, 90.0), Candidate("a:1", "ib0", 100_000, 12.0)],
        ),
        (
            [IB, Candidate("c:1", "eth2", probe_mb_s=5.0)],
            None,
            [Candidate("c:1", "eth2", probe_mb_s=5.0), IB],
        ),
        # the operator's pin keeps only its interface, even the slow one
        ([ETH, IB], "eth0", [ETH]),
    ],
)
def test_order(candidates: list[Candidate], pinned: str | None, expected: list[Candidate]) -> None:
    assert order(candidates, pinned) == expected


def test_a_pinned_interface_the_donor_does_not_offer_is_named() -> None:
    with pytest.raises(ValueError, match=r"'ib1' is not among .*10.0.0.1:80 \(eth0\)"):
        order([ETH, IB], "ib1")
    with pytest.raises(ValueError, match="offered no address"):
        order([])


def test_falls_back_in_order_and_reports_what_failed() -> None:
    tried: list[str] = []

    def attempt(c: Candidate) -> str:
        tried.append(c.address)
        if c is IB:
            raise ConnectionRefusedError("refused")
        return f"state via {c.address}"

    result, used, failures = first_that_works([IB, ETH, WIFI], attempt)
    assert (result, used) == ("state via 10.0.0.1:80", ETH)
    assert tried == ["10.1.0.1:80", "10.0.0.1:80"]  # WIFI not tried
    assert [f.candidate for f in failures] == [IB]


def test_no_working_address_names_each_one_tried_and_why() -> None:
    def attempt(c: Candidate) -> str:
        raise TimeoutError(f"no answer from {c.interface}")

    with pytest.raises(NoPathError) as error:
        first_that_works([IB, ETH], attempt)
    assert [f.candidate for f in error.value.failures] == [IB, ETH]
    message = str(error.value)
    assert "10.1.0.1:80 (TimeoutError: no answer from ib0)" in message
    assert "10.0.0.1:80 (TimeoutError: no answer from eth0)" in message
    with pytest.raises(ValueError, match="no address to try"):
        first_that_works([], attempt)
