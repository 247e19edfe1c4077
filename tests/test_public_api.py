"""The package root's lazy names (docs/torchft_mapping.md is checked by test_torchft_mapping.py)."""

from __future__ import annotations

import torchtitan_ft


def test_unknown_name_is_a_clear_attribute_error() -> None:
    try:
        torchtitan_ft.NoSuchThing  # noqa: B018
    except AttributeError as e:
        assert "NoSuchThing" in str(e)
    else:
        raise AssertionError("expected AttributeError")
