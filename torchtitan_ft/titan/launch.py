"""torchrun for ``run_train.sh``, the agent of one replica group's trainer processes:
``python -m torchtitan_ft.titan.launch [torchrun arguments]``.

It is ``python -m torch.distributed.run`` in every respect but one. When the failed workers
exited with :data:`USER_ERROR_EXIT` (or were stopped by torchrun's SIGTERM once the first of
them had exited), the workers have already said what is wrong in one line
(``torchtitan_ft: config error: ...`` and the other mistakes ``torchtitan_ft.titan.train``
reports), so torchrun's own report of the failure (an ERROR log line and a
``ChildFailedError`` traceback) is left out and the launcher exits with the same status. Any
other failure is reported by torchrun as usual.
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import Any

USER_ERROR_EXIT = 2
"""Exit status of a worker stopped by a mistake it explained in one line: a bad configuration,
an unreachable lighthouse, a replica group inconsistent with the job, a port in use."""

_AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"


class _DropUserErrorFailure(logging.Filter):
    """Drops torchrun's "failed (exitcode: 2) ..." line; other records pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(f"failed (exitcode: {USER_ERROR_EXIT})")


def main(argv: list[str] | None = None) -> None:
    """Runs torchrun with ``argv`` (default: the command line)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    logging.getLogger(_AGENT_LOGGER).addFilter(_DropUserErrorFailure())
    try:
        torchrun_main(sys.argv[1:] if argv is None else argv)
    except ChildFailedError as e:
        if _explained(list(e.failures.values())):
            raise SystemExit(USER_ERROR_EXIT) from None
        raise


def _explained(failures: list[Any]) -> bool:
    """Whether ``failures`` (torchrun's ``ProcessFailure``s) are user errors the workers
    explained: the first to fail exited with USER_ERROR_EXIT, and the others did too or were
    terminated by torchrun after it."""
    if not failures:
        return False
    first = min(failures, key=lambda f: f.timestamp)
    return first.exitcode == USER_ERROR_EXIT and all(
        f.exitcode in (USER_ERROR_EXIT, -signal.SIGTERM) for f in failures
    )


if __name__ == "__main__":
    main()
