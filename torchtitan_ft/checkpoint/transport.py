"""The contract between the Manager and a live-healing transport.

A healthy replica group's rank (the donor) offers its committed state for one step with
``send_checkpoint``; a recovering peer fetches it with ``recv_checkpoint`` using the donor's
``metadata()`` string, which the Manager passes around in its quorum requests. Once the step's
commit happened the Manager calls ``disallow_checkpoint`` and the donor stops offering it.
Same method names and arguments as torchft 0.2.0's ``CheckpointTransport``.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from datetime import timedelta
from typing import Generic, TypeVar

T = TypeVar("T")


class CheckpointTransferError(RuntimeError):
    """A checkpoint could not be received (source gone, reset, timeout, refused, malformed).

    Nothing of the checkpoint has been applied when this is raised; the Manager treats it as a
    failed heal and retries in the next quorum.
    """


class CheckpointTransport(Generic[T], ABC):
    """Moves a state dict from a donor rank to recovering ranks, with no disk in between."""

    @abstractmethod
    def metadata(self) -> str:
        """What a receiver needs to reach this sender (e.g. the HTTP server's URL)."""

    @abstractmethod
    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: T, timeout: timedelta
    ) -> None:
        """Offers ``state_dict`` as the committed state of ``step`` to ``dst_ranks``.

        Args:
            dst_ranks: replica ranks that will fetch it (transports that push, like
                ``PGTransport``, send to exactly these; ``HTTPTransport`` serves whoever asks).
            step: the step whose committed state this is; receivers asking for another step
                are refused.
            state_dict: nested dicts/lists/tuples of tensors and plain values.
            timeout: how long sending may take in total.
        """

    def disallow_checkpoint(self) -> None:  # optional hook, no-op by default
        """Stops offering the current step; called by the Manager once the step committed."""

    @abstractmethod
    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> T:
        """Fetches the state of ``step`` from the donor.

        Args:
            src_rank: the donor's replica rank.
            metadata: the donor's ``metadata()`` string.
            step: the step to fetch; the donor must be offering exactly this step.
            timeout: how long the whole transfer may take.

        Raises:
            CheckpointTransferError: when the transfer fails for any reason; nothing is
                returned or applied in that case.
        """

    # Optional: ``recv_checkpoint_borrowed(src_rank, metadata, step, timeout)``, the same
    # contract as ``recv_checkpoint`` except that the returned tensors may be views of a buffer
    # the transport reuses for its next receive (``HTTPTransport``'s). The Manager prefers it
    # and copies the tensors into the live state before the next heal.

    def shutdown(self, wait: bool = True) -> None:  # optional hook
        """Releases servers, threads and buffers.

        Args:
            wait: block until in-flight transfers and background threads finished.
        """


def log_received(
    logger: logging.Logger, step: int, src_rank: int, nbytes: int, started: float, via: str = ""
) -> None:
    """Logs one received state: its size, the time since ``started`` (``time.perf_counter``)
    and the rate; ``via`` ends the line (e.g. " over the process group")."""
    elapsed = time.perf_counter() - started
    logger.info(
        "received step %d from rank %d: %.1f MB in %.3f s (%.0f MB/s)%s",
        step,
        src_rank,
        nbytes / 1e6,
        elapsed,
        nbytes / 1e6 / max(elapsed, 1e-9),
        via,
    )
