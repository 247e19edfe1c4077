"""Tools for testing and benchmarking torchtitan_ft itself (not needed to train).

They live in the package, not under ``tests/``, because the tests, the benchmarks and the
scripts import them (and a trainer process started by ``run_train.sh`` can run one as its
``TRAIN_FILE``).

Processes and jobs:

- :mod:`torchtitan_ft.testing.processes`: a lighthouse as a killable subprocess, and worker
  processes driven by JSON lines (the benchmarks);
- :mod:`torchtitan_ft.testing.mlp`: the tiny-MLP harness, a replica-group rank training a tiny
  MLP with the whole FT loop as its own process (the multi-process tests, the chaos test,
  ``scripts/failure_demo.py --model mlp``); the rank itself is
  :mod:`torchtitan_ft.testing.mlp_rank`;
- :mod:`torchtitan_ft.testing.mlp_job`: the one job of such groups under a lighthouse process
  (spawn, replace, inject faults, read, stop, clean up);
- :mod:`torchtitan_ft.testing.commit_log`: that harness's per-step records and the invariants
  over them (identical states, no step regression, progress gaps);
- :mod:`torchtitan_ft.testing.faults`: the fault kinds, the seeded schedule and the rule for
  which groups a fault may take;
- :mod:`torchtitan_ft.testing.goodput_accounting`: ``benchmarks.goodput``'s pure accounting;
- :mod:`torchtitan_ft.testing.titan_jobs`: ``run_train.sh`` runs of the tests, waited for
  within the test's own timeout, with their logs in the report when a test fails;
- :mod:`torchtitan_ft.testing.titan_dump`: a ``TRAIN_FILE`` that trains as
  ``torchtitan_ft.titan.train`` does and dumps each rank's final state, so that a test can
  check that replica groups end identical;
- :mod:`torchtitan_ft.testing.titan_replacement`: one rank of a ``run_train.sh`` group
  SIGKILLed and the time until torchrun's replacement participates again (a ``--full`` test
  and ``benchmarks.recovery``);
- :mod:`torchtitan_ft.testing.goodput_worker`: the trainer of ``benchmarks.goodput``, this
  project's trainer plus one JSON line per step about what it committed;

Conditions to test under:

- :mod:`torchtitan_ft.testing.netns`: several hosts on one Linux machine (network namespaces
  joined by a bridge, with bandwidth limits and pulled cables) for multi-host tests and the
  ``benchmarks.wan`` benchmark; an operator can use it to rehearse a multi-host launch;
- :mod:`torchtitan_ft.testing.cpulimit`: a CPU limit on a set of processes (a cgroup quota,
  else a SIGSTOP/SIGCONT duty cycle), to slow a replica group down for real (the straggler
  tests and ``benchmarks.stragglers``);
- :mod:`torchtitan_ft.testing.flood`: a flood of HTTP/2 connections that hold a gRPC server's
  connection slots (the connection-guard tests and ``benchmarks/flood.py``);
- :mod:`torchtitan_ft.testing.gpu_check`: the parts of ``scripts/gpu_check.py``, the prepared
  check of the device paths (one process per part, a JSON result each); the parts that run the
  FT stack are in :mod:`torchtitan_ft.testing.gpu_parts`.
"""
