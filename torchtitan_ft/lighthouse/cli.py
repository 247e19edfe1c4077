"""``torchft_lighthouse``: runs a lighthouse until interrupted.

Flags and defaults match torchft's (``--bind``, ``--min_replicas``, ``--join_timeout_ms``,
``--quorum_tick_ms``, ``--heartbeat_timeout_ms``); ``--status_bind``, ``--auth_token`` and
``--version`` are ours. Bad values exit with code 2 and one line naming the flag.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import signal
import sys
from typing import NoReturn

from torchtitan_ft.lighthouse.server import LighthouseServer, validate_options
from torchtitan_ft.netaddr import join_host_port, port_in_use, split_host_port

PROG = "torchft_lighthouse"
AUTH_TOKEN_ENV = "TORCHFT_AUTH_TOKEN"


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
    p = _OneLineParser(prog=PROG, description="The torchft lighthouse: decides each step's quorum.")
    p.add_argument(
        "--version",
        action="version",
        version=version_line(),
        help="print the installed torchtitan_ft version and exit",
    )
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
        help=f"enables the status page's kill action, which then requires this "
        f"token (default: ${AUTH_TOKEN_ENV}, else no kill action)",
    )
    p.add_argument(
        "--log_level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="INFO logs each change of the decision's reason (default: %(default)s)",
    )
    return p


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        validate_options(
            args.min_replicas, args.join_timeout_ms, args.quorum_tick_ms, args.heartbeat_timeout_ms
        )
    except ValueError as e:
        parser.error(str(e))
    try:
        host, port = split_host_port(args.bind, "bind address")
    except ValueError as e:
        parser.error(f"--bind: {e}")
    if port_in_use(host, port):
        # gRPC would fail too, but only after logging a multi-line error of its own.
        parser.error(
            f"cannot bind the lighthouse to {args.bind} (port in use? another lighthouse?); "
            "pick a free port with --bind"
        )
    if args.status_bind is None:
        args.status_bind = join_host_port(host, port + 1 if port else 0)
    elif args.status_bind != "off":
        try:
            split_host_port(args.status_bind, "bind address")
        except ValueError as e:
            parser.error(f"--status_bind: {e}")
    token = args.auth_token if args.auth_token is not None else os.environ.get(AUTH_TOKEN_ENV)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        server = LighthouseServer(
            bind=args.bind,
            min_replicas=args.min_replicas,
            join_timeout_ms=args.join_timeout_ms,
            quorum_tick_ms=args.quorum_tick_ms,
            heartbeat_timeout_ms=args.heartbeat_timeout_ms,
            status_bind=None if args.status_bind == "off" else args.status_bind,
            auth_token=token or None,
        )
    except OSError as e:
        parser.error(str(e))
    signal.signal(signal.SIGTERM, lambda *_: server.shutdown())
    try:
        server.wait()
    except KeyboardInterrupt:
        server.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
