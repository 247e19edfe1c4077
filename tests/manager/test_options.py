"""``ManagerOptions``: the Manager's own options in one frozen dataclass, given as ``options=``
or as keywords of the same names (``ManagerOptions.of``), never both."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from torchtitan_ft.manager.options import ManagerOptions
from torchtitan_ft.manager.settings import resolve_manager_settings


def test_keywords_and_options_give_the_same_options() -> None:
    assert ManagerOptions.of(None, {}) == ManagerOptions()
    given = ManagerOptions(auth_token="t", samples_per_batch=8)
    assert ManagerOptions.of(given, {}) is given
    assert ManagerOptions.of(None, {"auth_token": "t", "samples_per_batch": 8}) == given


def test_both_ways_at_once_or_an_unknown_keyword_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match=r"options= and the keywords \['events_dir'\]"):
        ManagerOptions.of(ManagerOptions(), {"events_dir": "/tmp/e"})
    with pytest.raises(TypeError, match=r"\['sample_per_batch'\].*'samples_per_batch'"):
        ManagerOptions.of(None, {"sample_per_batch": 8})


def test_a_non_bool_retry_is_refused_and_the_options_are_frozen() -> None:
    with pytest.raises(ValueError, match="retry_inflight_allreduce must be a bool, got 'yes'"):
        ManagerOptions(retry_inflight_allreduce="yes")  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        ManagerOptions().auth_token = "t"  # type: ignore[misc]


def test_every_option_an_env_var_can_give_goes_to_the_settings_resolution() -> None:
    """The fields ``resolve_manager_settings`` takes are exactly those it is given, by name."""
    fields = {f.name for f in dataclasses.fields(ManagerOptions)}
    resolved = set(inspect.signature(resolve_manager_settings).parameters) & fields
    given = ManagerOptions(
        auth_token="t", events_dir="/e", samples_per_batch=3
    ).settings_arguments()
    assert set(given) == resolved
    assert (given["auth_token"], given["events_dir"], given["samples_per_batch"]) == ("t", "/e", 3)
