"""Process-wide state of the process groups (``torchtitan_ft.process_group.lifecycle``):
importing the package registers nothing; the first gloo group installs the exit and fork hooks.
Checked in a fresh interpreter, since this one already created groups."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import atexit, json, os
import torch.distributed  # its own hooks, registered before ours would be
before = atexit._ncallbacks()
import torchtitan_ft
from torchtitan_ft import ProcessGroupGloo
from torchtitan_ft.process_group import lifecycle
imported = atexit._ncallbacks()
installed_at_import = lifecycle._hooks_installed
pg = ProcessGroupGloo()
created = atexit._ncallbacks()
ProcessGroupGloo()
print(json.dumps([before, imported, installed_at_import, created, atexit._ncallbacks(),
                  lifecycle._hooks_installed]))
"""


def test_hooks_are_installed_by_the_first_group_not_by_import() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True
    )
    before, imported, installed_at_import, created, second, installed = json.loads(
        out.stdout.splitlines()[-1]
    )
    assert imported == before and not installed_at_import
    assert created == before + 1 and installed
    assert second == created  # once per process
