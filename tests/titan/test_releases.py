"""The TorchTitan release is chosen by what is installed (torchtitan_ft/titan/releases)."""

import subprocess
import sys

import pytest

from torchtitan_ft.titan import releases
from torchtitan_ft.titan.releases import Release, UnsupportedReleaseError, release_for_version


@pytest.mark.parametrize(
    ("version", "release"),
    [("0.2.2", Release.V0_2), ("0.3.0", Release.V0_3), ("0.3.0+cpu", Release.V0_3)],
)
def test_supported_versions(version: str, release: Release) -> None:
    assert release_for_version(version) is release


@pytest.mark.parametrize(
    ("version", "named"),
    [(None, "not installed"), ("0.2.1", "0.2.1 is installed"), ("0.3.1", "0.3.1 is installed")],
)
def test_other_versions_are_refused_naming_the_supported_ones(version, named: str) -> None:
    with pytest.raises(UnsupportedReleaseError) as error:
        release_for_version(version)
    assert named in str(error.value)
    assert "0.2.2, 0.3.0" in str(error.value)


def test_the_installed_release_is_printed_for_run_train_sh() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "torchtitan_ft.titan.releases"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout == f"{releases.installed().value}\n"
    assert releases.installed().module.__name__.endswith(releases.installed().name.lower())
