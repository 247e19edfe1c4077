"""``torchft_lighthouse``: runs a lighthouse until interrupted (or, with ``--exit_when_idle_ms``,
until its job is over).

Flags and defaults match torchft's (``--bind``, ``--min_replicas``, ``--join_timeout_ms``,
``--quorum_tick_ms``, ``--heartbeat_timeout_ms``); ``--status_bind``, ``--auth_token`` and
``--version`` are ours. Bad values exit with code 2 and one line naming the flag.

``--exit_when_idle_ms`` (ours) ends a lighthouse that a launcher starts beside the groups once
the job is over (``lighthouse.lifetime``). ``torchft_lighthouse status --lighthouse ADDR``
(ours) prints a running lighthouse's status page as text instead (``lighthouse.summary``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import logging
import os
import resource
import signal
import sys
import time
from collections.abc import Mapping
from typing import NoReturn

from torchtitan_ft.auth import AUTH_TOKEN_ENV, check_token
from torchtitan_ft.lighthouse import lifetime, summary
from torchtitan_ft.lighthouse.exclusion import ExclusionOptions, StragglerPolicy
from torchtitan_ft.lighthouse.history import DEFAULT_CAPACITY
from torchtitan_ft.lighthouse.server import LighthouseServer, validate_options
from torchtitan_ft.lighthouse.stragglers import StragglerOptions
from torchtitan_ft.netaddr import join_host_port, split_host_port

PROG = "torchft_lighthouse"
logger = logging.getLogger(PROG)


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def version_line() -> str:
    """What ``--version`` prints: the installed package's version and the protocol it speaks."""
    try:
        version = importlib.metadata.version("torchtitan_ft")
    except importlib.metadata.PackageNotFoundError:
        version = "(not installed)"
    return f"{PROG} {version} (torchtitan_ft; torchft 0.2.0 gRPC protocol)"


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(
        prog=PROG,
        description="The torchft lighthouse: decides each step's quorum. "
        f"'{PROG} status --lighthouse ADDR' prints a running one's status page as text.",
    )
    p.add_argument(
        "--version",
        action="version",
        version=version_line(),
        help="print the installed torchtitan_ft version and exit",
    )
    _add_quorum_flags(p)
    _add_straggler_flags(p)
    _add_state_flags(p)
    return p


def _add_quorum_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the gRPC server, the quorum decision, the status page and the token."""
    p.add_argument(
        "--bind", default="[::]:29510", help="host:port of the gRPC server (default: %(default)s)"
    )
    p.add_argument(
        "--min_replicas",
        type=int,
        required=True,
        help="fewest replica groups a quorum may have (>= 1)",
    )
    p.add_argument(
        "--join_timeout_ms",
        type=int,
        default=60000,
        help="ms a round waits for healthy replicas that have not asked yet (default: %(default)s)",
    )
    p.add_argument(
        "--quorum_tick_ms",
        type=int,
        default=100,
        help="ms between decisions of rounds that wait on time (default: %(default)s)",
    )
    p.add_argument(
        "--heartbeat_timeout_ms",
        type=int,
        default=5000,
        help="ms without a heartbeat after which a replica is unhealthy; replicas "
        "with a heartbeat stream are dropped at once when it ends "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--status_bind",
        default=None,
        help="host:port of the HTTP status page, JSON and /metrics; 'off' serves none "
        "(default: the --bind host, port + 1, e.g. [::]:29511)",
    )
    p.add_argument(
        "--auth_token",
        default=None,
        help=f"the job token: every gRPC call (quorum, heartbeats) and the status page's kill "
        f"action then need it; give the replica groups the same fault_tolerance.auth_token "
        f"(default: ${AUTH_TOKEN_ENV}, else none: anyone who reaches the port can join "
        f"quorums, and there is no kill action). Prefer the env var: a flag is visible in "
        f"the process list",
    )


def _add_straggler_flags(p: argparse.ArgumentParser) -> None:
    """The straggler report's and policy's flags."""
    p.add_argument(
        "--straggler_factor",
        type=float,
        default=StragglerOptions.factor,
        help="a replica group whose median compute time is this many times the others' is "
        "slow; lower catches milder slowdowns, but risks false reports on a loaded machine "
        "(> 1; default: %(default)s)",
    )
    p.add_argument(
        "--straggler_steps",
        type=int,
        default=StragglerOptions.steps,
        help="slow steps in a row before a group is reported as a straggler, and fast steps "
        "before the report ends; the report changes nothing for the job (>= 1; "
        "default: %(default)s)",
    )
    p.add_argument(
        "--straggler_link_factor",
        type=float,
        default=StragglerOptions.link_factor,
        help="a replica group whose median link probe (a timed round trip of a payload to "
        "the lighthouse) is this many times slower than the others' has a slow link; the "
        "cross-group all-reduce holds every group to the slowest link, so step times cannot "
        "name it (> 1; default: %(default)s)",
    )
    p.add_argument(
        "--straggler_link_probes",
        type=int,
        default=StragglerOptions.link_probes,
        help="slow link probes in a row before a group is reported as a straggler for its "
        "link, and fast probes before that report ends (>= 1; default: %(default)s)",
    )
    p.add_argument(
        "--straggler_link_probe_bytes",
        type=int,
        default=StragglerOptions.link_probe_bytes,
        help="payload of a group's link probe, bytes, sent each way; 0: the groups send no "
        "probes and links are not judged. Larger measures fast links better, smaller costs "
        "less (0 to 524288; default: %(default)s)",
    )
    p.add_argument(
        "--straggler_link_probe_interval_ms",
        type=int,
        default=round(StragglerOptions.link_probe_interval_s * 1000),
        help="least ms between two link probes of a group (it probes at most once per quorum, "
        "right after it); shorter detects a slow link in fewer steps, longer costs less "
        "(>= 0; default: %(default)s)",
    )
    p.add_argument(
        "--straggler_policy",
        type=StragglerPolicy,
        choices=list(StragglerPolicy),
        default=StragglerPolicy.OFF,
        help="off: report stragglers only; exclude: leave a reported straggler out of the "
        "quorum while the others are at least --min_replicas (it trains alone without "
        "committing, and is taken back and heals when it is fast again); the others stop "
        "waiting for it, at the cost of its compute (default: %(default)s)",
    )
    p.add_argument(
        "--straggler_min_excluded_ms",
        type=int,
        default=round(ExclusionOptions.min_excluded_s * 1000),
        help="ms a left-out group stays out before being fast again takes it back (not when "
        "the quorum needs it for --min_replicas); longer damps flapping (>= 0; "
        "default: %(default)s)",
    )
    p.add_argument(
        "--straggler_max_exclusions",
        type=int,
        default=ExclusionOptions.max_exclusions,
        help="times a group may be left out per --straggler_exclusion_window_ms; then it stays "
        "in, reported (>= 1; default: %(default)s)",
    )
    p.add_argument(
        "--straggler_exclusion_window_ms",
        type=int,
        default=round(ExclusionOptions.window_s * 1000),
        help="ms over which --straggler_max_exclusions counts (> 0; default: %(default)s)",
    )


def _add_state_flags(p: argparse.ArgumentParser) -> None:
    """The flags of what the lighthouse keeps, when it exits, and its log."""
    p.add_argument(
        "--state_dir",
        default=None,
        help="directory where the lighthouse keeps the job's event history (events.jsonl, "
        "append-only, at most about 2 x --history_events lines), so that a restarted "
        "lighthouse still shows what happened before, the groups' figures (groups.json: time "
        "in the quorum and away, heals, discarded steps, committed samples, availability; "
        "rewritten every second), and the last quorum it issued (last_quorum.json), so that a "
        "restarted lighthouse's state guard acts as before the restart; quorum ids are "
        "restart-safe without it (default: none, all are kept in memory only and lost on "
        "restart)",
    )
    p.add_argument(
        "--history_events",
        type=int,
        default=DEFAULT_CAPACITY,
        help="events of the job's history kept in memory, shown by the status page and "
        "/events; about 30 bytes each plus their reasons' text (>= 1; default: %(default)s)",
    )
    p.add_argument(
        "--exit_when_idle_ms",
        type=int,
        default=0,
        help="exit (status 0) once a quorum has been issued and then no replica group has been "
        "healthy for this many ms: for a lighthouse started beside the groups as one "
        "application (torchtitan_ft.torchx), which ends only when all its processes do. Longer "
        "than a group's restart, or a job whose every group restarts at once loses its "
        "lighthouse (0, the default: run until interrupted)",
    )
    p.add_argument(
        "--log_level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="INFO logs each change of the decision's reason (default: %(default)s)",
    )


def resolve_auth_token(flag: str | None, env: Mapping[str, str]) -> tuple[str | None, str]:
    """The job token and where it came from: ``--auth_token`` > ``$TORCHFT_AUTH_TOKEN`` > none.

    Raises ValueError for an empty ``--auth_token`` (an empty env var counts as unset), and for
    a token no client could present (``auth.check_token``), naming where it came from.
    """
    if flag is not None:
        if not flag:
            raise ValueError("--auth_token is empty; pass the job token or leave the flag out")
        token, source = flag, "--auth_token"
    elif value := env.get(AUTH_TOKEN_ENV):
        token, source = value, f"${AUTH_TOKEN_ENV}"
    else:
        return None, "none"
    check_token(token, source)
    return token, source


def default_status_bind(host: str, port: int) -> str:
    """The status page's default: the gRPC host, port + 1 (a free port for port 0)."""
    if port == 65535:
        raise ValueError(
            "--bind port 65535 leaves no port for the status page (it defaults to port + 1); "
            "pass --status_bind host:port, or --status_bind off"
        )
    return join_host_port(host, port + 1 if port else 0)


def _raise_fd_limit() -> None:
    """Lifts the soft descriptor limit to the hard one: every connection takes one, and the
    servers size their connection caps from the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):  # else the caps follow the soft limit
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def _exit_cleanly(*_: object) -> NoReturn:
    sys.exit(0)


def build_status_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(
        prog=f"{PROG} status",
        description="Prints a running lighthouse's status page as text: the job's figures, "
        "each group's, the quorum and the newest events with their reasons.",
    )
    p.add_argument(
        "--lighthouse",
        required=True,
        help="the lighthouse's address, as the replica groups know it (http://host:port or "
        "host:port); its status server is read at port + 1 unless --status is given",
    )
    p.add_argument(
        "--status",
        default=None,
        help="host:port of the lighthouse's status server, when its --status_bind is not the "
        "default (default: the --lighthouse host, port + 1)",
    )
    p.add_argument(
        "--token",
        default=None,
        help=f"the job token, sent as 'Authorization: Bearer' (the status page's reads do not "
        f"need it today; a proxy in front of it may) (default: ${AUTH_TOKEN_ENV}, else none)",
    )
    return p


def status_main(argv: list[str]) -> None:
    """``torchft_lighthouse status``: prints the summary; exit 2 on bad flags, 1 when the
    status server cannot be read."""
    parser = build_status_parser()
    args = parser.parse_args(argv)
    try:
        base = summary.status_url(args.lighthouse, args.status)
        token, _ = resolve_auth_token(args.token, os.environ)
    except ValueError as e:
        parser.error(str(e).replace("--auth_token", "--token"))
    try:
        status, events = summary.fetch(base, token)
    except OSError as e:
        sys.exit(f"{PROG} status: {e}")
    sys.stdout.write(summary.render(status, events))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["status"]:
        status_main(argv[1:])
        return
    parser = build_parser()
    args = parser.parse_args(argv)
    stragglers, exclusion = _checked_options(parser, args)
    _check_binds(parser, args)
    try:
        token, token_source = resolve_auth_token(args.auth_token, os.environ)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    _raise_fd_limit()
    if token is not None:
        logger.info("job token from %s", token_source)
    # The server logs that it serves before the constructor returns: a SIGTERM from then on
    # is a clean stop, not death by signal.
    signal.signal(signal.SIGTERM, _exit_cleanly)
    try:
        server = LighthouseServer(
            bind=args.bind,
            min_replicas=args.min_replicas,
            join_timeout_ms=args.join_timeout_ms,
            quorum_tick_ms=args.quorum_tick_ms,
            heartbeat_timeout_ms=args.heartbeat_timeout_ms,
            status_bind=None if args.status_bind == "off" else args.status_bind,
            auth_token=token,
            stragglers=stragglers,
            exclusion=exclusion,
            state_dir=args.state_dir,
            history_events=args.history_events,
        )
    except OSError as e:
        parser.error(str(e))
    signal.signal(signal.SIGTERM, lambda *_: server.shutdown())
    try:
        if args.exit_when_idle_ms:
            _serve_until_idle(server, args.exit_when_idle_ms / 1000)
        else:
            server.wait()
    except KeyboardInterrupt:
        server.shutdown()
    sys.exit(0)


def _checked_options(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[StragglerOptions, ExclusionOptions]:
    """``main``'s checks of the decision's, the straggler report's and the history's flags
    (``parser.error`` names a bad one); the straggler options they give."""
    try:
        validate_options(
            args.min_replicas, args.join_timeout_ms, args.quorum_tick_ms, args.heartbeat_timeout_ms
        )
    except ValueError as e:
        parser.error(str(e))
    if args.straggler_link_probe_interval_ms < 0:
        parser.error(
            f"--straggler_link_probe_interval_ms must be >= 0, "
            f"got {args.straggler_link_probe_interval_ms}"
        )
    try:
        stragglers = StragglerOptions(
            factor=args.straggler_factor,
            steps=args.straggler_steps,
            link_factor=args.straggler_link_factor,
            link_probes=args.straggler_link_probes,
            link_probe_bytes=args.straggler_link_probe_bytes,
            link_probe_interval_s=args.straggler_link_probe_interval_ms / 1000,
        )
    except ValueError as e:
        parser.error(f"--{e}".replace("straggler ", "straggler_", 1))
    for flag, value, least in (
        ("--straggler_min_excluded_ms", args.straggler_min_excluded_ms, 0),
        ("--straggler_max_exclusions", args.straggler_max_exclusions, 1),
        ("--straggler_exclusion_window_ms", args.straggler_exclusion_window_ms, 1),
    ):
        if value < least:
            parser.error(f"{flag} must be >= {least}, got {value}")
    if args.history_events < 1:
        parser.error(f"--history_events must be >= 1, got {args.history_events}")
    if args.exit_when_idle_ms < 0:
        parser.error(f"--exit_when_idle_ms must be >= 0 (0: never), got {args.exit_when_idle_ms}")
    exclusion = ExclusionOptions(
        policy=args.straggler_policy,
        min_excluded_s=args.straggler_min_excluded_ms / 1000,
        max_exclusions=args.straggler_max_exclusions,
        window_s=args.straggler_exclusion_window_ms / 1000,
    )
    return stragglers, exclusion


def _check_binds(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``main``'s checks of ``--bind`` and ``--status_bind`` (``parser.error`` says what is
    wrong); sets the default ``--status_bind``."""
    try:
        host, port = split_host_port(args.bind, "bind address")
    except ValueError as e:
        parser.error(f"--bind: {e}")
    if not host:
        # gRPC would log its own error line before refusing the port.
        parser.error(
            f"--bind {args.bind!r} has no host; give one, e.g. 127.0.0.1:{port} or [::]:{port}"
        )
    if args.status_bind is None:
        try:
            args.status_bind = default_status_bind(host, port)
        except ValueError as e:
            parser.error(str(e))
    elif args.status_bind != "off":
        try:
            split_host_port(args.status_bind, "bind address")
        except ValueError as e:
            parser.error(f"--status_bind: {e}")


def _serve_until_idle(server: LighthouseServer, idle_s: float) -> None:
    """Serves until ``lifetime.should_exit`` says the job is over, then shuts down (or until
    the server stops on a signal)."""
    idle = lifetime.Idle()
    look_every_s = min(1.0, idle_s / 4)
    while not server.wait(look_every_s):
        seen = server.run_in_loop(lambda: (server.state.quorum is not None, server.state.healthy()))
        now = time.monotonic()
        idle = lifetime.look(idle, seen[0], len(seen[1]), now)
        if lifetime.should_exit(idle, now, idle_s):
            logger.info("no replica group for %.1f s after the job's quorums: exiting", idle_s)
            server.shutdown()
            return


if __name__ == "__main__":
    main()
