"""TorchTitan 0.3.0 tests: they run in the 0.3.0 environment (``./run_tests.sh`` runs them
there, in the venv of ``scripts/install_torchtitan_env.sh 0.3.0``) and are skipped, with the
command that runs them, in an environment with another TorchTitan. The fixtures of
tests/titan (each test's wait budget, the runs' logs in a failure report) apply here too."""

import pytest

from tests.titan.conftest import _job_budget, pytest_runtest_makereport  # noqa: F401
from torchtitan_ft.titan import releases

RUN_HERE = (
    "TorchTitan 0.3.0 tests; this Python has TorchTitan "
    f"{releases.installed_version()}: run them with ./run_tests.sh tests/titan030"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if releases.installed_version() == releases.Release.V0_3.value:
        return
    skip = pytest.mark.skip(reason=RUN_HERE)
    for item in items:
        if "titan030" in item.nodeid.split("/"):
            item.add_marker(skip)
