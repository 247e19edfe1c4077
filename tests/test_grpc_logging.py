"""grpc's C core logs errors only (``GRPC_VERBOSITY``, set by the package root before grpc is
imported), unless the user chose a verbosity. ``GRPC_TRACE=http`` makes the core log an INFO
line per HTTP/2 frame, like the "Got goaway" lines it prints at shutdown."""

from __future__ import annotations

import os
import re
import subprocess
import sys

PROBE = """
from datetime import timedelta
from torchtitan_ft.lighthouse import LighthouseClient, LighthouseServer
server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
LighthouseClient(server.address()).heartbeat("probe", timedelta(seconds=10))
server.shutdown()
"""
CORE_LINE = re.compile(r"^[IW]\d{4} .*\.cc:\d+\]", re.MULTILINE)


def _core_lines(**env: str) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**base, "GRPC_TRACE": "http", **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return CORE_LINE.findall(out.stderr)


def test_core_info_lines_are_silenced_unless_asked_for() -> None:
    assert _core_lines() == []
    assert len(_core_lines(GRPC_VERBOSITY="INFO")) > 10
