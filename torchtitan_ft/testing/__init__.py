"""Tools for testing and benchmarking torchtitan_ft itself (not needed to train).

- :mod:`torchtitan_ft.testing.netns`: several hosts on one Linux machine (network namespaces
  joined by a bridge, with bandwidth limits and pulled cables) for multi-host tests and the
  ``benchmarks.wan`` benchmark. It lives in the package, not under ``tests/``, because both the
  tests and the benchmarks import it, and an operator can use it to rehearse a multi-host
  launch on one machine.
- :mod:`torchtitan_ft.testing.mlp`: the tiny-MLP harness, a replica-group rank training a tiny
  MLP with the whole FT loop as its own process (the multi-process tests, the chaos test,
  ``scripts/failure_demo.py --model mlp``);
- :mod:`torchtitan_ft.testing.mlp_job`: the one job of such groups under a lighthouse process
  (spawn, replace, inject faults, read, stop, clean up);
- :mod:`torchtitan_ft.testing.commit_log`: that harness's per-step records and the invariants
  over them (identical states, no step regression, progress gaps);
- :mod:`torchtitan_ft.testing.faults`: the fault kinds, the seeded schedule and the rule for
  which groups a fault may take;
- :mod:`torchtitan_ft.testing.goodput_accounting`: ``benchmarks.goodput``'s pure accounting;
- :mod:`torchtitan_ft.testing.processes`: a lighthouse as a killable subprocess, and worker
  processes driven by JSON lines (the benchmarks);
- :mod:`torchtitan_ft.testing.gpu_check`: the parts of ``scripts/gpu_check.py``, the prepared
  check of the device paths (one process per part, a JSON result each).
"""
