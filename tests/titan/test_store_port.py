"""``titan.store_port``: the workers' store port comes from outside the ephemeral range, and
concurrent picks on one machine never share one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from torchtitan_ft.titan import store_port


@pytest.mark.parametrize(
    ("text", "expected"),
    [("32768\t60999\n", (32768, 60999)), ("1024 65535", (1024, 65535))],
)
def test_ephemeral_range_parses_the_proc_file(text: str, expected: tuple[int, int]) -> None:
    assert store_port.ephemeral_range(text) == expected


@pytest.mark.parametrize(
    ("first", "last", "expected"),
    [
        (32768, 60999, range(61000, 65536)),  # Linux's default: above it
        (32768, 65000, range(1024, 32768)),  # little above: below it
        (1024, 65535, range(0)),  # everything is ephemeral: no pick (torchrun's own)
        (2000, 64999, range(0)),
    ],
)
def test_candidates_lie_outside_the_ephemeral_range(first: int, last: int, expected: range) -> None:
    assert store_port.candidates(first, last) == expected


def test_picks_of_two_processes_never_share_a_port() -> None:
    """A port stays claimed while its picker lives: another process picking meanwhile gets
    another one, from outside this machine's ephemeral range."""
    first, last = store_port.ephemeral_range(store_port.EPHEMERAL_RANGE_FILE.read_text())
    if not store_port.candidates(first, last):
        pytest.skip(f"no ports outside the ephemeral range {first}-{last} here")
    mine = store_port.pick()
    assert mine is not None and not first <= mine <= last
    code = (
        "import random\n"
        "from torchtitan_ft.titan import store_port\n"
        "class MineFirst(random.Random):\n"  # tries the parent's port first
        "    tried = False\n"
        "    def choice(self, seq):\n"
        "        if self.tried:\n"
        "            return super().choice(seq)\n"
        "        self.tried = True\n"
        f"        return {mine}\n"
        "print(store_port.pick(MineFirst()))\n"
    )
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert int(other) != mine
    assert not first <= int(other) <= last


def test_the_launchers_workers_get_the_picked_port(tmp_path: Path) -> None:
    """torchrun's agent under ``titan.launch`` gives its workers a MASTER_PORT from outside the
    ephemeral range (torchrun alone draws it from inside, with a port 0 bind)."""
    first, last = store_port.ephemeral_range(store_port.EPHEMERAL_RANGE_FILE.read_text())
    if not store_port.candidates(first, last):
        pytest.skip(f"no ports outside the ephemeral range {first}-{last} here")
    out = tmp_path / "port"
    result = subprocess.run(
        [sys.executable, "-m", "torchtitan_ft.titan.launch", "--nproc_per_node=1",
         "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", "--no-python", "sh", "-c",
         f'echo "$MASTER_PORT" > {out}'],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    port = int(out.read_text())
    assert not first <= port <= last
