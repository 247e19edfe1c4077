"""TorchTitan 0.2.2 integration: CPU compatibility, config, data, trainer.

Importing this subpackage applies the CPU compatibility fixes first (a no-op when CUDA is
available), so its modules, and TorchTitan imported after them, see device type "cpu" on a
CPU-only torch. Modules:

* ``cpu_compat``: the runtime fixes that make TorchTitan run on CPU/gloo.
* ``config``: the extended ``fault_tolerance`` section, parsing and validation.
* ``data``: the project's corpus and tokenizer, registered as TorchTitan datasets.
* ``replica_axis``: the FT replica axis seen by the trainer (data split, gradient hook).
* ``trainer``: ``FaultTolerantTrainer``, TorchTitan's Trainer with those seams.

The entry point is ``python -m torchtitan_ft.train`` (``run_train.sh``).
"""

from torchtitan_ft.titan import cpu_compat

cpu_compat.apply_before_torchtitan_import(strict=False)
