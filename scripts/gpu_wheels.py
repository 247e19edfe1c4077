"""Downloads the wheels ``scripts/gpu_check.py --wheels`` installs on a GPU machine that reaches
no package registry: Python 3.12, manylinux x86_64, everything the check imports besides the
machine's own torch. Prints JSON (the wheels, their sizes, the total).

    python scripts/gpu_wheels.py --dest DIR [--chunk-mib 60] [--torchtitan-version 0.3.0]

What goes in: the closure of :func:`roots` (the project's runtime dependencies less torch, with
the TorchTitan release asked for: ``--torchtitan-version``, else ``TORCHTITAN_VERSION``, else
0.3.0, as ``scripts/install.sh``; anything but a supported release is refused in one line,
exit 2), following each wheel's ``Requires-Dist`` under Python 3.12 on Linux, less
:data:`PROVIDED` (torch and what torch itself requires: the machine's torch brings them) and
:data:`UNUSED` (required by a package but never imported by the check). Every requirement met
inside the set is also checked against its version range; one that is not met fails the
download (exit 1).

With 0.2.2 the set was about 105 MiB, most of it ``datasets``' pyarrow (52 MiB) and pandas
(12 MiB), and a device call carries at most 64 MiB: ``--chunk-mib N`` puts the wheels into
``DIR/chunk1``, ``DIR/chunk2``, ... of at most N MiB each, to carry one per call into one
``--site`` folder of ``gpu_check.py`` on a machine kept warm (docs/titan.md, "On a GPU").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import NormalizedName, canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from torchtitan_ft.titan.releases import Release  # noqa: E402  (imports neither torch nor titan)

DEPENDENCIES = (
    # First: the closure takes the newest version meeting the first requirement it meets, and
    # datasets 4.7 (the newest of the range) bounds huggingface-hub below 2, which
    # tokenizers' requirement alone would not.
    "datasets>=3.6,<4.8",
    "tyro>=1.0.17,<2",
    "grpcio>=1.85.1,<2",
    "protobuf>=7.35.1,<8",
    "tomli>=2.0",
    "torchdata>=0.11",
    "tensorboard>=2.16",
    "tokenizers>=0.21",
)
"""pyproject.toml's runtime dependencies without torch and triton (the machine's own) and
TorchTitan (:func:`roots` adds the release)."""

DEFAULT_RELEASE = Release.V0_3
"""The release when neither the flag nor ``TORCHTITAN_VERSION`` names one (install.sh's)."""


def release_asked(flag: str | None, env: str | None) -> Release:
    """The release ``--torchtitan-version`` (``flag``), else ``TORCHTITAN_VERSION`` (``env``),
    names, else :data:`DEFAULT_RELEASE`. Raises ValueError naming the value and the supported
    releases for anything else."""
    value = flag or env
    if not value:
        return DEFAULT_RELEASE
    for release in Release:
        if release.value == value:
            return release
    supported = ", ".join(r.value for r in Release)
    where = "--torchtitan-version" if flag else "TORCHTITAN_VERSION"
    raise ValueError(
        f"{where}={value} is not a supported TorchTitan release (expected {supported})"
    )


def roots(release: Release) -> tuple[str, ...]:
    """What the check needs on ``release``: that TorchTitan and :data:`DEPENDENCIES`."""
    return (f"torchtitan=={release.value}", *DEPENDENCIES)


PROVIDED = frozenset(
    canonicalize_name(n)
    for n in ("torch", "triton", "sympy", "mpmath", "networkx", "jinja2", "markupsafe",
              "filelock", "fsspec", "typing-extensions", "setuptools")
)  # fmt: skip
"""What an installed torch requires (its nvidia-* and cuda-* packages too, by prefix)."""

UNUSED = frozenset(canonicalize_name(n) for n in ("pillow", "einops", "wandb"))
"""Required by TorchTitan for its flux and vision models (pillow, einops) and its wandb logger
(0.3.0; the check enables none): neither release imports them at start."""

MARKERS = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "os_name": "posix",
    "extra": "",
}
"""The GPU machine, for the requirements' environment markers."""

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any")


def provided(name: NormalizedName) -> bool:
    return name in PROVIDED or name.startswith(("nvidia-", "cuda-"))


def closure(
    roots: tuple[str, ...], fetch: Callable[[Requirement], tuple[Version, list[str]]]
) -> tuple[dict[NormalizedName, Version], list[str]]:
    """The packages ``roots`` need: ``fetch(requirement)`` gets one (a version meeting it) and
    returns its version and ``Requires-Dist`` lines. Returns {name: version} and the unmet
    requirements (a package already in the set at a version outside a later range)."""
    got: dict[NormalizedName, Version] = {}
    wanted: list[tuple[Requirement, str]] = [(Requirement(r), "the check") for r in roots]
    unmet = []
    while wanted:
        req, by = wanted.pop(0)
        name = canonicalize_name(req.name)
        if provided(name) or name in UNUSED:
            continue
        if name in got:
            if not req.specifier.contains(got[name], prereleases=True):
                unmet.append(f"{by} needs {req}, the set has {name} {got[name]}")
            continue
        got[name], requires = fetch(req)
        for line in requires:
            dep = Requirement(line)
            if dep.marker is None or dep.marker.evaluate(MARKERS):
                wanted.append((dep, f"{name} {got[name]}"))
    return got, unmet


def chunks(sizes: dict[str, int], limit: int) -> list[list[str]]:
    """The files ``sizes`` ({file: bytes}) in groups of at most ``limit`` bytes each, largest
    first, each into the first group with room (a file over the limit is a group alone)."""
    groups: list[tuple[int, list[str]]] = []
    for name, size in sorted(sizes.items(), key=lambda item: (-item[1], item[0])):
        for i, (used, files) in enumerate(groups):
            if used + size <= limit:
                groups[i] = (used + size, [*files, name])
                break
        else:
            groups.append((size, [name]))
    return [files for _, files in groups]


def _requires_dist(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        lines = z.read(meta).decode().splitlines()
    return [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]


def _downloader(dest: Path) -> Callable[[Requirement], tuple[Version, list[str]]]:
    def fetch(req: Requirement) -> tuple[Version, list[str]]:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
        command += ["--disable-pip-version-check", "--only-binary=:all:", "--python-version"]
        command += [MARKERS["python_version"], "--dest", str(dest)]
        command += [arg for p in PLATFORMS for arg in ("--platform", p)]
        done = subprocess.run(
            [*command, str(req).split(";")[0]], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise SystemExit(f"pip download {req} failed: {done.stderr.strip()[-500:]}")
        name = canonicalize_name(req.name)
        (wheel,) = [w for w in dest.glob("*.whl") if parse_wheel_filename(w.name)[0] == name]
        return parse_wheel_filename(wheel.name)[1], _requires_dist(wheel)

    return fetch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", type=Path, required=True, help="folder for the wheels")
    parser.add_argument(
        "--torchtitan-version",
        help="the TorchTitan release of the set (default: $TORCHTITAN_VERSION, else "
        f"{DEFAULT_RELEASE.value}, as scripts/install.sh)",
    )
    parser.add_argument(
        "--chunk-mib", type=int, default=0,
        help="put the wheels into chunk folders of at most this many MiB (default 0: one folder)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        release = release_asked(args.torchtitan_version, os.environ.get("TORCHTITAN_VERSION"))
    except ValueError as e:
        print(f"gpu_wheels: {e}", file=sys.stderr)
        return 2
    args.dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu_wheels_") as tmp:
        got, unmet = closure(roots(release), _downloader(Path(tmp)))
        sizes = {w.name: w.stat().st_size for w in Path(tmp).glob("*.whl")}
        groups = chunks(sizes, args.chunk_mib << 20) if args.chunk_mib else [sorted(sizes)]
        for i, files in enumerate(groups, 1):
            folder = args.dest / f"chunk{i}" if args.chunk_mib else args.dest
            folder.mkdir(exist_ok=True)
            for name in files:
                shutil.move(Path(tmp) / name, folder / name)
    summary = {
        "python": MARKERS["python_version"],
        "torchtitan": release.value,
        "packages": {name: str(version) for name, version in sorted(got.items())},
        "total_mib": round(sum(sizes.values()) / 2**20, 1),
        "folders": {
            str(args.dest / f"chunk{i}" if args.chunk_mib else args.dest): round(
                sum(sizes[f] for f in files) / 2**20, 1
            )
            for i, files in enumerate(groups, 1)
        },
        "unmet": unmet,
    }
    print(json.dumps(summary, indent=2))
    return 1 if unmet else 0


if __name__ == "__main__":
    sys.exit(main())
