"""``./run_local.sh``'s job on TorchTitan 0.3.0, the release ``./run_local.sh`` installs by
default: the registry's ``llama3_debugmodel`` in 0.2.2's local-job shape, with the same checks
as on 0.2.2 (tests/titan/test_local_job.py: it trains, one prefix per line, no known harmless
warning)."""

import pytest

from tests.titan.test_local_job import check_local_job


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_local_job_prints_one_prefix_per_line_and_no_known_harmless_warning() -> None:
    check_local_job()
