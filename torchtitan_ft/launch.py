"""torchrun for ``run_train.sh``: ``python -m torchtitan_ft.launch [torchrun arguments]``.

It is ``python -m torch.distributed.run`` in every respect but one. When every failed worker
exited with :data:`CONFIG_ERROR_EXIT`, the worker has already said what is wrong in one line
(``torchtitan_ft: config error: ...``, see ``torchtitan_ft.train``), so torchrun's own report of
the failure (an ERROR log line and a ``ChildFailedError`` traceback) is left out and the launcher
exits with the same status. Any other failure is reported by torchrun as usual.
"""

from __future__ import annotations

import logging
import sys

CONFIG_ERROR_EXIT = 2
"""Exit status of a worker stopped by a configuration error (a usage error, as for a CLI)."""

_AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"


class _DropConfigErrorFailure(logging.Filter):
    """Drops torchrun's "failed (exitcode: 2) ..." line; other records pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(f"failed (exitcode: {CONFIG_ERROR_EXIT})")


def main(argv: list[str] | None = None) -> None:
    """Runs torchrun with ``argv`` (default: the command line)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    logging.getLogger(_AGENT_LOGGER).addFilter(_DropConfigErrorFailure())
    try:
        torchrun_main(sys.argv[1:] if argv is None else argv)
    except ChildFailedError as e:
        if e.failures and all(f.exitcode == CONFIG_ERROR_EXIT for f in e.failures.values()):
            raise SystemExit(CONFIG_ERROR_EXIT) from None
        raise


if __name__ == "__main__":
    main()
