"""Benchmarks: scripts that print one JSON document (``python -m benchmarks.<name>``).

Every document records the machine it was measured on (:func:`machine`): a figure from a CPU
with native bf16 says little about one without, and this machine's load changes from run to run.
"""

import os


def machine() -> dict:
    """The CPU (model, torch capability, bf16 support), core count and 1-minute load average."""
    from torchtitan_ft.titan.compute_dtype import describe_cpu

    return {**describe_cpu(), "cores": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]}
