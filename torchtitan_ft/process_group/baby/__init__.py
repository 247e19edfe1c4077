"""Process groups whose collectives run in a child process, in every rank (torchft's "baby"
process groups): ``ProcessGroupBabyGloo`` and ``ProcessGroupBabyNCCL``.

Some hangs cannot be interrupted from inside the process that hangs: a transport wedged in C++
code ignores timeouts and aborts, and freeing it may block its caller. Here the real group (a
:class:`ProcessGroupGloo` or :class:`ProcessGroupNCCL`) lives in a child process spawned by every
:meth:`ProcessGroupBaby.configure`; the parent sends each collective to it over a pipe and the
child reports completion. When a collective overruns the timeout, the parent SIGKILLs the child:
everything the transport held goes with it, the parent never waits for it, and the next
``configure`` spawns a fresh child.

Tensors cross the process boundary through shared memory: a CPU tensor passed to a collective
is moved to shared memory (``Tensor.share_memory_()``, in place, once), and the child writes
results straight into it. CUDA tensors are shared by CUDA IPC (untested here: no GPU).

Layers, one module each: ``wire`` (what crosses the pipes: arguments made picklable, the
messages of the pipe protocol), ``child`` (the child's loop) and ``parent`` (the groups).

Costs: ``configure`` spawns a Python process that imports torch (seconds, not milliseconds),
and each collective adds a pipe round trip. A daemonic ``multiprocessing`` process cannot
start the child (``configure`` says so). Prefer :class:`ProcessGroupGloo`, which already
gives up on a hung collective at its timeout, unless a transport has been seen to wedge.
"""

from torchtitan_ft.process_group.baby.parent import (
    CHILD_START_TIMEOUT_S,
    ProcessGroupBaby,
    ProcessGroupBabyGloo,
    ProcessGroupBabyNCCL,
)

__all__ = [
    "CHILD_START_TIMEOUT_S",
    "ProcessGroupBaby",
    "ProcessGroupBabyGloo",
    "ProcessGroupBabyNCCL",
]
