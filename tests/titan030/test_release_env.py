"""The 0.3.0 tests and every Python they start see TorchTitan 0.3.0 (the same check as
tests/titan/test_release_env.py on 0.2.2)."""

from tests.titan.test_release_env import assert_every_python_sees
from torchtitan_ft.titan import releases


def test_every_python_the_tests_start_trains_on_0_3_0() -> None:
    assert_every_python_sees(releases.Release.V0_3)
