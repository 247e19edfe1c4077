"""The TorchTitan release under test is the one every Python the tests start trains with.
``./run_tests.sh`` runs the main suite in the 0.2.2 venv and tests/titan030 in the 0.3.0 one,
each with its bin first on ``PATH`` and ``PYTHON`` set to its Python (docs/development.md), so
that the base Python's own TorchTitan (0.3.0 after ``scripts/install.sh``) stays out of the
0.2.2 run. tests/titan030/test_release_env.py checks the same on 0.3.0."""

from __future__ import annotations

import os
import subprocess

from torchtitan_ft.testing.titan_jobs import ROOT
from torchtitan_ft.titan import releases

_PROBE = "from torchtitan_ft.titan import releases; print(releases.installed_version())"


def releases_seen() -> dict[str, str | None]:
    """The TorchTitan version each Python the tests may start sees: this process's, the
    ``python3`` first on ``PATH`` (scripts, examples, a user's commands) and ``$PYTHON``
    (``run_train.sh``'s, ``python3`` where unset)."""
    seen: dict[str, str | None] = {"this process": releases.installed_version()}
    pythons = {"python3 on PATH": "python3", "$PYTHON": os.environ.get("PYTHON", "python3")}
    for name, python in pythons.items():
        run = subprocess.run(
            [python, "-c", _PROBE],
            cwd="/",  # the installed TorchTitan decides, not the checkout's files
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        seen[name] = run.stdout.strip() if run.returncode == 0 else f"failed: {run.stderr}"
    return seen


def assert_every_python_sees(release: releases.Release) -> None:
    seen = releases_seen()
    assert seen == dict.fromkeys(seen, release.value), (
        f"these tests run on TorchTitan {release.value}, with the venv of "
        f"scripts/install_torchtitan_env.sh {release.value} first on PATH and PYTHON set to "
        f"its Python (./run_tests.sh does both); seen: {seen}"
    )


def test_every_python_the_tests_start_trains_on_0_2_2() -> None:
    assert_every_python_sees(releases.Release.V0_2)
