"""The runtime of a replica group, on every rank: the Manager and the pieces it drives (group
rank 0 also runs the group's ManagerServer, ``server.py``).

Bottom to top: ``decisions``, ``identity``, ``outage``, ``settings`` and ``rounds`` make
decisions without I/O (functions of their inputs, plus the small state of
``decisions.QuorumGate`` and ``rounds.GroupRounds``); ``stats`` holds the counters;
``steptimes`` turns a rank's step timings into the group's for the straggler report;
``client``/``server`` speak ``torchft.ManagerService`` (``lighthouse_quorum``: the server's
quorum requests to the lighthouse); ``rendezvous`` (start-up),
``step_collectives``, ``healing``, ``quorum`` (the quorum thread), ``ledger`` (the step account)
and ``progress`` (what a rank reports with each quorum request) hold one rank's state;
``hung`` watches for hung peers on a thread of its own while a step's collectives run,
``retry`` finishes a step a peer died in with the survivors, ``linkprobe`` times the
group's link to the lighthouse, and ``recovery`` cuts group rank 0's own recoveries into
phases for the lighthouse; ``options`` holds the Manager's own options
(``ManagerOptions``), ``parts`` builds a Manager's parts, and ``manager`` is the façade a
training loop calls. torchft 0.2.0's names are importable here.
"""

from torchtitan_ft.manager.client import (
    ManagerClient,
    QuorumTimeoutError,
    ReplicaGroupMismatchError,
)
from torchtitan_ft.manager.decisions import QuorumResult, WorldSizeMode
from torchtitan_ft.manager.identity import model_fingerprint
from torchtitan_ft.manager.manager import Manager
from torchtitan_ft.manager.options import ManagerOptions
from torchtitan_ft.manager.outage import LighthouseOutage
from torchtitan_ft.manager.server import AddressInUseError, ManagerServer
from torchtitan_ft.manager.stats import ManagerStats
from torchtitan_ft.manager.step_collectives import ExceptionWithTraceback

__all__ = [
    "AddressInUseError",
    "ExceptionWithTraceback",
    "LighthouseOutage",
    "Manager",
    "ManagerClient",
    "ManagerOptions",
    "ManagerServer",
    "ManagerStats",
    "QuorumResult",
    "QuorumTimeoutError",
    "ReplicaGroupMismatchError",
    "WorldSizeMode",
    "model_fingerprint",
]
