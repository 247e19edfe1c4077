"""One prepared check of the device paths (issue 25): runs each part of
``torchtitan_ft.testing.gpu_check`` in a process of its own under its time limit, and writes
``OUT/report.json`` (every part's status, reason, figures, checks, error and wall time) with
each part's log in ``OUT/<part>.log``.

    python scripts/gpu_check.py --out DIR [--device cuda|cpu] [--wheels DIR] [--parts ...]

- ``--device cuda`` (default): everything on the GPU; the CUDA limits add up to 450 s, so a
  whole run fits in 8 minutes on one H100. ``--device cpu``: the reduced version the test suite
  runs (``tests/testing/test_gpu_check.py``); the ``nccl`` part then runs its sequence on gloo
  and reports itself skipped.
- ``--wheels DIR``: a folder of wheels (``scripts/gpu_wheels.py`` makes it for Python 3.12)
  installed first, with pip and no package index, into the ``--site`` folder; the parts then
  import from that folder and from this checkout, and use the machine's own torch.
- ``--site DIR``: that folder (default ``OUT/site-packages``). Given without ``--wheels``, the
  parts use what an earlier call installed there (wheels carried in chunks, one per call).
- ``--parts``: some of environment, manager, nccl, native_nccl2, semi_sync, titan (default:
  all).

Exit status 0 when no part failed, 1 when one did or the wheels did not install, 2 for bad
arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from torchtitan_ft.testing.gpu_check import (  # noqa: E402  (after the checkout is on the path)
    PARTS,
    PartResult,
    Status,
    overall,
    plan,
    settle,
)

STOP_GRACE_S = 15.0
"""After its limit a part gets SIGTERM (its clean-up kills the runs it started), then SIGKILL
after this many seconds."""


def install_wheels(wheels: Path, target: Path, log: Path) -> list[str]:
    """Installs every wheel of ``wheels`` into ``target`` (no index, no dependency resolution:
    the folder is the whole set); the wheels' file names."""
    files = sorted(wheels.glob("*.whl"))
    if not files:
        raise SystemExit(f"--wheels {wheels}: no .whl files there")
    command = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--quiet"]
    command += ["--disable-pip-version-check", "--target", str(target), *map(str, files)]
    with log.open("w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        raise SystemExit(f"installing the wheels failed ({done.returncode}); see {log}")
    return [f.name for f in files]


def run_one(part: str, device: str, out: Path, env: dict[str, str]) -> PartResult:
    """Runs ``part`` in its own process (its own session) under its limit; its outcome."""
    limit = PARTS[part].limit_s[device]
    result_file = out / f"{part}.json"
    result_file.unlink(missing_ok=True)
    command = [sys.executable, "-m", "torchtitan_ft.testing.gpu_check", part]
    command += ["--device", device, "--out", str(out)]
    started = time.monotonic()
    with (out / f"{part}.log").open("w") as log:
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            returncode: int | None = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            returncode = None
            _stop(proc)
    wall = time.monotonic() - started
    result = None
    if result_file.exists():
        data = json.loads(result_file.read_text())
        result = PartResult(**{**data, "status": Status(data["status"])})
    return settle(result, returncode, limit, wall)


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder of the report and logs")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--wheels", type=Path, help="folder of wheels to install first")
    parser.add_argument("--site", type=Path, help="folder they go to (default OUT/site-packages)")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), metavar="PART")
    args = parser.parse_args(argv)
    started, started_utc = time.monotonic(), datetime.now(UTC).isoformat(timespec="seconds")
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out.resolve()

    path = [str(ROOT)]
    installed: list[str] = []
    site = (args.site or out / "site-packages").resolve()
    if args.wheels is not None:
        installed = install_wheels(args.wheels, site, out / "wheels.log")
    if site.is_dir():
        path.append(str(site))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, os.environ.get("PYTHONPATH", "")])}
    probe = "import torch; print(int(torch.cuda.is_available()))"
    cuda = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=False
    ).stdout.strip()
    try:
        parts = plan(args.parts, args.device, cuda == "1")
    except ValueError as e:
        parser.error(str(e))

    results: dict[str, PartResult] = {}
    for part in parts:
        results[part] = run_one(part, args.device, out, env)
        print(f"{part}: {results[part].status.value} in {results[part].wall_s} s "
              f"{results[part].reason}", flush=True)  # fmt: skip
    status = overall(results)
    report = {
        "command": " ".join(["python", "scripts/gpu_check.py", *(argv or sys.argv[1:])]),
        "device": args.device,
        "started_utc": started_utc,
        "status": status.value,
        "wall_s": round(time.monotonic() - started, 1),
        "wheels_installed": installed,
        "site": str(site) if site.is_dir() else None,
        "limits_s": {p: PARTS[p].limit_s[args.device] for p in parts},
        "parts": {p: r.to_json() for p, r in results.items()},
    }
    (out / "report.json").write_text(json.dumps(report, indent=2))
    print(f"gpu_check: {status.value} in {report['wall_s']} s; report {out / 'report.json'}")
    return 1 if status is Status.FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
