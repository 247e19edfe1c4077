"""Every name of docs/torchft_mapping.md is importable from the package root and its module."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import torchtitan_ft

MAPPING = Path(__file__).resolve().parent.parent / "docs/torchft_mapping.md"


def test_documented_names_resolve() -> None:
    rows = [line for line in MAPPING.read_text().splitlines() if line.startswith("| `torchft")]
    assert len(rows) >= 9
    checked = set()
    for row in rows:
        modules = re.findall(r"`(torchtitan_ft\.[a-z_.]+)`", row)
        if not modules:  # the CLI row
            continue
        tokens = (t.rsplit(".", 1)[-1] for t in re.findall(r"`([A-Za-z_.]+)`", row))
        for name in {t for t in tokens if t[0].isupper()}:
            module = modules[-1]
            checked.add(name)
            assert getattr(importlib.import_module(module), name) is getattr(torchtitan_ft, name)
    assert {"Manager", "DiLoCo", "HTTPTransport", "LighthouseServer"} <= checked


def test_unknown_name_is_a_clear_attribute_error() -> None:
    try:
        torchtitan_ft.NoSuchThing  # noqa: B018
    except AttributeError as e:
        assert "NoSuchThing" in str(e)
    else:
        raise AssertionError("expected AttributeError")
