"""Tools for testing and benchmarking torchtitan_ft itself (not needed to train).

- :mod:`torchtitan_ft.testing.netns`: several hosts on one Linux machine (network namespaces
  joined by a bridge, with bandwidth limits and pulled cables) for multi-host tests and the
  ``benchmarks.wan`` benchmark. It lives in the package, not under ``tests/``, because both the
  tests and the benchmarks import it, and an operator can use it to rehearse a multi-host
  launch on one machine.
"""
