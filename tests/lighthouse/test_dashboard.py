"""The lighthouse status page rendered by a real browser (headless Chromium)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from tests.lighthouse._helpers import ask_all

CHROMIUM = shutil.which("chromium")
pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(CHROMIUM is None, reason="chromium missing: scripts/install_browser.sh"),
]
MEMBER_ROW_RGB = (0xDF, 0xF5, 0xE1)  # tr.member td background in status.py


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", *args,
        ],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip


def member_row_bands(png: Path) -> int:
    """Horizontal bands of the member-row colour down the first table column."""
    image = Image.open(png).convert("RGB")
    width, height = image.size
    bands, inside = 0, False
    for y in range(height):
        hit = any(image.getpixel((x, y)) == MEMBER_ROW_RGB for x in range(0, width // 3, 4))
        if hit and not inside:
            bands += 1
        inside = hit
    return bands


def test_status_page_in_headless_chromium_shows_the_members(servers, tmp_path: Path) -> None:
    server = servers(min_replicas=3, status_bind="127.0.0.1:0")
    ask_all(server.address(), ["rg-a", "rg-b", "rg-c"], step=42)
    url = server.status_address() + "/"

    dom = chromium(tmp_path, "--dump-dom", url).stdout
    assert len(re.findall(r'<tr class="member">', dom)) == 3
    for rid in ["rg-a", "rg-b", "rg-c"]:
        assert f"<td>{rid}</td>" in dom
    # Everything the page loads comes from the lighthouse itself: no CDN, no external host.
    assert not re.findall(r'(?:src|href)="(?:https?:)?//', dom)

    png = tmp_path / "status.png"
    chromium(tmp_path, f"--screenshot={png}", "--window-size=1200,2400", url)  # whole page
    assert member_row_bands(png) == 3
