"""Byte buffers a donor snapshots its state into, and byte views of tensors.

A ``Staging`` buffer is one flat block of host memory holding the snapshot's tensors back to
back. On Linux it is a memfd, so a server can hand its pages to a socket with ``sendfile``
(no copy through user space on the donor); elsewhere it is anonymous memory sent with
``sendall``. Buffers are reused from snapshot to snapshot: copying into memory that is already
mapped is several times faster than faulting in fresh pages.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import queue
import socket
import struct
import sys
import threading
from collections.abc import Sequence

import torch

from torchtitan_ft.checkpoint._serialization import TensorSpec, available_memory

_PAGE = mmap.PAGESIZE
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_PREFAULT_PIECE = 8 << 20
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
if _libc is not None:
    _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


class Staging:
    """A flat host buffer of ``capacity`` bytes; ``tensor`` is a uint8 view of all of it."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(_PAGE, -(-capacity // _PAGE) * _PAGE)
        self._fd: int | None = None
        if hasattr(os, "memfd_create"):
            self._fd = os.memfd_create("torchtitan_ft-heal-staging", os.MFD_CLOEXEC)
            os.ftruncate(self._fd, self.capacity)
            self._mm = mmap.mmap(self._fd, self.capacity)
        else:
            self._mm = mmap.mmap(-1, self.capacity)
        self.tensor: torch.Tensor | None = torch.frombuffer(self._mm, dtype=torch.uint8)

    def fill(self, tensors: list[torch.Tensor], offsets: list[int]) -> None:
        """Copies each tensor's bytes to its offset (a device-to-host copy for accelerators)."""
        if self.tensor is None:
            raise RuntimeError("staging buffer used after close()")
        for t, offset in zip(tensors, offsets, strict=True):
            n = t.numel() * t.element_size()
            if n:
                self.tensor[offset : offset + n].copy_(as_bytes(t))

    def send(self, sock: socket.socket, offset: int, count: int) -> None:
        """Writes ``count`` bytes from ``offset`` to a *blocking* socket.

        One ``sendfile`` call moves everything without the GIL (a Python loop per socket-buffer
        refill would need the GIL back each time, and a donor's training thread holds it
        often). ``SO_SNDTIMEO`` (see ``set_io_timeout``) ends it when the receiver stops
        reading (TimeoutError), but restarts with every bit it reads: to bound the whole send,
        shut the socket down from another thread. With sendfile the socket may still
        reference the pages after this returns, until the peer has read them: do not overwrite
        the range before the peer closed the connection.
        """
        end = offset + count
        with memoryview(self._mm) as mv:
            while offset < end:
                try:
                    if self._fd is not None:
                        n = os.sendfile(sock.fileno(), self._fd, offset, end - offset)
                    else:
                        n = sock.send(mv[offset:end])
                except BlockingIOError:
                    raise TimeoutError("the receiver stopped reading") from None
                if n == 0:
                    raise ConnectionResetError("the receiver closed the connection")
                offset += n

    def close(self) -> None:
        """Unmaps the buffer; pages a socket still references stay alive until it drops them."""
        self.tensor = None
        # BufferError: a view of it is still alive; the mapping then goes with the last one.
        with contextlib.suppress(BufferError):
            self._mm.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


_RECEIVE_ALIGN = 64
"""Each tensor of a ``ReceiveBuffer`` starts at a multiple of this (any dtype's alignment)."""


class ReceiveBuffer:
    """A receiver's area for incoming states, reused from one receive to the next.

    Receiving into memory whose pages are already mapped runs at socket speed; receiving into
    new tensors is bound by first-touch page faults (docs/performance.md, "Healing
    transfer"). ``views`` lays a state's tensors out in one buffer, growing it (new memory,
    ``fresh`` pages) only when a state does not fit. The views of a receive are overwritten by
    the next one: whoever holds them copies what it keeps first. Memory cost: the largest
    state received so far (plus alignment), held until the owner drops the buffer.
    """

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held now (0 before the first receive)."""
        return 0 if self._buffer is None else self._buffer.numel()

    def views(self, specs: Sequence[TensorSpec]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Tensors of the specs' dtypes and shapes laid out in the buffer, and the part of the
        buffer that is new memory (empty when the buffer was reused as it is).

        Raises:
            ValueError: the state needs more memory than this machine has available.
        """
        offsets, end = [], 0
        for s in specs:
            offsets.append(end)
            end += -(-s.nbytes // _RECEIVE_ALIGN) * _RECEIVE_ALIGN
        fresh: list[torch.Tensor] = []
        if end > self.nbytes:
            self._buffer = None  # views of the old buffer keep it alive until dropped
            needed = end - self.nbytes
            available = available_memory()
            if needed > available:
                raise ValueError(
                    f"the sender's header describes {end} bytes of tensors; growing the receive "
                    f"buffer needs {needed} bytes, more than the {available} available here"
                )
            try:
                self._buffer = torch.empty(end, dtype=torch.uint8)
            except (RuntimeError, MemoryError) as e:  # the allocator refused
                raise ValueError(f"cannot allocate the {end} bytes announced: {e}") from e
            fresh = [self._buffer]
        buffer = self._buffer
        tensors = [
            buffer[o : o + s.nbytes].view(s.dtype).view(s.shape)
            if s.nbytes
            else torch.empty(s.shape, dtype=s.dtype)
            for s, o in zip(specs, offsets, strict=True)
        ]
        return tensors, fresh


def set_io_timeout(sock: socket.socket, seconds: float) -> None:
    """Makes ``sock`` blocking, with kernel-side send and receive timeouts.

    Blocking calls then run entirely in the kernel with the GIL released; a timed-out call
    raises BlockingIOError (or returns a partial count).
    """
    sock.settimeout(None)
    sec = max(0.0, seconds)
    timeval = struct.pack("ll", int(sec), int((sec % 1) * 1e6) or (0 if sec >= 1 else 1000))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as a flat uint8 tensor (a view when it is contiguous)."""
    return t.detach().resolve_conj().resolve_neg().reshape(-1).view(torch.uint8)


def writable_view(t: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's bytes; keep ``t`` alive while used."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


class Prefaulter:
    """Faults in the pages of freshly allocated tensors on a helper thread.

    A receiver's time is dominated by first-touch page faults of its new tensors as much as by
    copying bytes out of the socket. One long-lived helper thread (no thread start per
    transfer) populates the pages, in stream order, while the receiving thread copies, so the
    two overlap. ``MADV_POPULATE_WRITE`` never changes a page's contents, so it is safe to race
    with the receiver, and even to run on after the tensors were freed (it then faults in or
    fails on whatever is mapped there, harmlessly): ``cancel`` need not wait for it. A no-op
    where unsupported.

    Populated pages are real memory, while allocated ones are only address space: with
    ``window`` the helper stays at most that many bytes of the stream ahead of what the
    receiver reported as received (``PrefaultJob.advance``), so a sender that announces more
    than it sends makes the receiver commit only what arrived plus the window.
    """

    _lock = threading.Lock()
    _jobs: queue.SimpleQueue[PrefaultJob] | None = None

    @classmethod
    def submit(cls, tensors: list[torch.Tensor], window: int | None = None) -> PrefaultJob:
        """Queues the tensors' pages (in this order: the stream's) for population; returns a
        handle to report progress, cancel or wait on. ``window``: None runs ahead freely."""
        pieces = []
        stream = 0
        for t in tensors:
            start = t.data_ptr()
            nbytes = t.numel() * t.element_size()
            lo = -(-start // _PAGE) * _PAGE
            hi = (start + nbytes) // _PAGE * _PAGE
            pieces += [
                (a, min(_PREFAULT_PIECE, hi - a), stream + a - start)
                for a in range(lo, hi, _PREFAULT_PIECE)
            ]
            stream += nbytes
        job = PrefaultJob(pieces, window)
        if _libc is None or not pieces:
            job.done.set()
            return job
        with cls._lock:
            if cls._jobs is None:
                cls._jobs = queue.SimpleQueue()
                threading.Thread(
                    target=cls._run, args=(cls._jobs,), name="heal-prefault", daemon=True
                ).start()
            cls._jobs.put(job)
        return job

    @staticmethod
    def _run(jobs: queue.SimpleQueue[PrefaultJob]) -> None:
        supported = True
        while True:
            job = jobs.get()
            for a, n, stream_offset in job.pieces:
                if not supported or not job.may_populate(stream_offset):
                    break
                failed = _libc.madvise(a, n, _MADV_POPULATE_WRITE)
                if failed and ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS, errno.EPERM):
                    supported = False  # old kernel: receivers fault pages in as usual
            job.done.set()


class PrefaultJob:
    def __init__(self, pieces: list[tuple[int, int, int]], window: int | None) -> None:
        self.pieces = pieces
        """(address, length, offset in the stream) of each piece to populate."""
        self.window = window
        self.received = 0
        self.cancelled = threading.Event()
        self.done = threading.Event()
        self._progress = threading.Condition()

    def advance(self, nbytes: int) -> None:
        """The receiver got ``nbytes`` more bytes of the stream (from any of its threads)."""
        if self.window is None:
            return
        with self._progress:
            self.received += nbytes
            self._progress.notify()

    def may_populate(self, stream_offset: int) -> bool:
        """Waits until the piece at ``stream_offset`` is within the window; False once
        cancelled."""
        if self.window is not None:
            with self._progress:
                while stream_offset > self.received + self.window and not self.cancelled.is_set():
                    self._progress.wait(0.05)
        return not self.cancelled.is_set()

    def cancel(self) -> None:
        """Stops at the next piece; does not wait (see ``Prefaulter``)."""
        self.cancelled.set()

    def wait(self) -> None:
        """Blocks until every page was populated (or the job was cancelled)."""
        self.done.wait()
