"""``python -m tests._spare_train '<WorkerConfig as JSON>'``:
``torchtitan_ft.testing.mlp_rank.train_worker`` as a command line, for tests that start it under
``torchtitan_ft.spare``."""

import json
import sys

from torchtitan_ft.testing.mlp import WorkerConfig
from torchtitan_ft.testing.mlp_rank import train_worker

if __name__ == "__main__":
    train_worker(WorkerConfig(**json.loads(sys.argv[1])))
