"""Which of a donor's addresses a healing group fetches the state from, and the fallback when
one fails (pure: the candidates, their measurements and the attempt are inputs).

torchft #329: the donor advertised a host name that resolved to its Ethernet interface, so
the state crossed Ethernet (800 s) while InfiniBand sat idle (20 s when pinned by hand). Here
the donor offers every address it can serve on (:class:`Candidate`); the healer orders them by
what it knows (:func:`order`): a measured probe rate first (fastest first), then the link
speed the kernel reports, then the donor's own order; an operator's pinned interface keeps
only the candidates on it. It then tries them in that order (:func:`first_that_works`) and
falls back to the next when one fails; when none works, one error names each address tried
and why (:class:`NoPathError`).

Not wired into the transports yet (the donor's offer and the probe are the next step).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Candidate:
    """One address a donor can serve its state on."""

    address: str
    """``host:port`` (or a URL) to fetch from."""
    interface: str | None = None
    """The donor's interface name for it (``ib0``, ``eth0``), when the donor said."""
    link_mbit_s: float | None = None
    """The link speed the kernel reports for the path (Mbit/s), when known."""
    probe_mb_s: float | None = None
    """The rate a short probe measured towards it (MB/s), when probed."""


def order(candidates: Sequence[Candidate], pinned: str | None = None) -> list[Candidate]:
    """The candidates in the order to try them: probed ones by measured rate (fastest first),
    then the others by reported link speed (fastest first), then in the donor's order (the
    sort is stable). ``pinned`` (an interface name) keeps only the candidates on it.

    Raises:
        ValueError: no candidates; ``pinned`` names no offered interface (the message lists
            those offered).
    """
    if not candidates:
        raise ValueError("the donor offered no address to heal from")
    if pinned:
        kept = [c for c in candidates if c.interface == pinned]
        if not kept:
            offered = ", ".join(
                f"{c.address} ({c.interface or 'interface not said'})" for c in candidates
            )
            raise ValueError(
                f"the pinned heal interface {pinned!r} is not among the donor's addresses: "
                f"{offered}; pin one of those interfaces or unpin it"
            )
        candidates = kept

    def key(c: Candidate) -> tuple[int, float, float]:
        if c.probe_mb_s is not None:
            return (0, -c.probe_mb_s, 0.0)
        return (1, 0.0, -(c.link_mbit_s or 0.0))

    return sorted(candidates, key=key)


@dataclass(frozen=True)
class Failure:
    """An address tried in vain, and why."""

    candidate: Candidate
    error: BaseException

    def describe(self) -> str:
        """``address (ErrorType: message)``."""
        return f"{self.candidate.address} ({type(self.error).__name__}: {self.error})"


class NoPathError(RuntimeError):
    """None of the donor's addresses worked; ``failures`` says each one tried and why."""

    def __init__(self, failures: Sequence[Failure]) -> None:
        self.failures = list(failures)
        super().__init__(
            "no address of the donor worked; tried, in order: "
            + "; ".join(f.describe() for f in self.failures)
        )


def first_that_works(
    ordered: Sequence[Candidate], attempt: Callable[[Candidate], T]
) -> tuple[T, Candidate, list[Failure]]:
    """Calls ``attempt`` on each candidate in turn until one returns; returns its result, the
    candidate and the failures before it (for the event stream and the log).

    Raises:
        NoPathError: every attempt raised (an ``Exception``; anything else propagates).
        ValueError: no candidates.
    """
    if not ordered:
        raise ValueError("no address to try")
    failures: list[Failure] = []
    for candidate in ordered:
        try:
            return attempt(candidate), candidate, failures
        except Exception as e:  # recorded: the next candidate is tried
            failures.append(Failure(candidate, e))
    raise NoPathError(failures)
