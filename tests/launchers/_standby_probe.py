"""What a Slurm standby became (tests/launchers/test_slurm.py): prints its process, argv and
environment as JSON. ``body_runs``: how many times this module's body ran in the process (2:
the standby imported it before it ran as ``__main__``)."""

import json
import os
import sys

os.environ["PROBE_BODY_RUNS"] = str(int(os.environ.get("PROBE_BODY_RUNS", "0")) + 1)

if __name__ == "__main__":
    print(
        json.dumps(
            {
                "pid": os.getpid(),
                "body_runs": int(os.environ["PROBE_BODY_RUNS"]),
                "argv": sys.argv,
                "from_assignment": os.environ.get("FROM_ASSIGNMENT"),
                "from_standby": os.environ.get("FROM_STANDBY"),
            }
        )
    )
