"""``torchft_lighthouse status``: the status page's summary as text, for an operator on SSH.

It reads the lighthouse's status server (``/status.json`` and ``/events``) and prints the job's
figures, each group's, each group's recoveries phase by phase, the current quorum and the
newest events with their reasons.
``render`` is a pure function of what those endpoints return.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from torchtitan_ft.auth import AUTHORIZATION
from torchtitan_ft.lighthouse import recoveries
from torchtitan_ft.lighthouse.timeline import clock
from torchtitan_ft.netaddr import join_host_port, split_host_port

EVENTS_PRINTED = 20
"""The newest events printed."""
_TIMEOUT_S = 10.0


def status_url(lighthouse: str, status: str | None) -> str:
    """The status server's base URL: ``status`` (``host:port`` or a URL) when given, else the
    lighthouse's host at its port + 1 (the lighthouse's default ``--status_bind``).

    Raises:
        ValueError: an address without a host or port, naming it.
    """
    if status is not None:
        host, port = split_host_port(urlsplit(status).netloc or status, "--status address")
        return f"http://{join_host_port(host, port)}"
    host, port = split_host_port(urlsplit(lighthouse).netloc or lighthouse, "--lighthouse address")
    if not host:
        raise ValueError(f"--lighthouse {lighthouse!r} has no host; e.g. http://host:29510")
    return f"http://{join_host_port(host, port + 1)}"


def fetch(base: str, token: str | None) -> tuple[dict, dict]:
    """``/status.json`` and the newest ``/events`` of the status server at ``base``.

    Raises:
        OSError: the server cannot be reached or answered an error, naming the URL.
    """

    def get(path: str) -> dict:
        request = urllib.request.Request(base + path)
        if token is not None:
            request.add_header(AUTHORIZATION, f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            raise OSError(f"{base}{path} answered {e.code}: {e.read().decode()[:200]}") from None
        except (urllib.error.URLError, TimeoutError) as e:
            reason = getattr(e, "reason", e)
            raise OSError(
                f"cannot reach the lighthouse's status server at {base} ({reason}); is it "
                "running, and is its --status_bind this address (give it with --status)?"
            ) from None

    status = get("/status.json")
    since = max(0, status["last_event_seq"] - EVENTS_PRINTED)
    return status, get(f"/events?since={since}")


def _num(value: float | None, fmt: str, suffix: str = "") -> str:
    return "-" if value is None else format(value, fmt) + suffix


def render(status: dict, events: dict) -> str:
    """The text summary of ``/status.json`` and ``/events`` answers."""
    job = status["job"]
    avail = job["availability"]
    unit = job["unit"]
    lines = [
        f"lighthouse: {status['reason']}",
        (
            f"job: {job[f'{unit}_committed']} {unit} committed, "
            f"{_num(job[f'{unit}_per_s'], '.2f')} {unit}/s over the last "
            f"{job['sustained_window_s']:g} s (best {_num(job[f'best_{unit}_per_s'], '.2f')}), "
            f"availability {_num(None if avail is None else 100 * avail, '.1f', '%')} at full "
            f"membership ({job['full_membership']} groups), "
            f"{job['discarded_steps']} discarded steps"
        ),
    ]
    if "unit_reason" in job:
        lines.append(f"  ({job['unit_reason']})")
    if status.get("state_loss"):
        lines.append(state_loss_line(status["state_loss"]))
    quorum = status["quorum"]
    if quorum is None:
        lines.append("quorum: none yet")
    else:
        members = ", ".join(f"{m['replica_id']}@{m['step']}" for m in quorum["members"])
        lines.append(f"quorum {quorum['quorum_id']} (age {quorum['age_s']:.1f} s): {members}")
    lines += [
        "",
        f"{'group':<28} {'launcher job':<24} {'in':<3} {'steps/s':>8} {'in quorum s':>11} "
        f"{'away s':>8} {'heals':>5} {'last heal':<28} {'discarded':>9}",
    ]
    for g in status["groups"]:
        last = g["heals"][-1] if g["heals"] else None
        heal = f"{last['seconds']:.3f} s {last['bytes']} B {last['outcome']}" if last else "-"
        lines.append(
            f"{g['replica_id'][:28]:<28} {g['launcher_job'] or '-':<24} "
            f"{'yes' if g['in_quorum'] else 'no':<3} "
            f"{_num(g['steps_per_s'], '.2f'):>8} {g['in_quorum_s']:>11.1f} {g['away_s']:>8.1f} "
            f"{g['heal_count']:>5} {heal:<28} {g['discarded_steps']:>9}"
        )
    lines += recoveries.text_lines(status["groups"])
    if status["other_callers"]:
        lines.append(
            f"(heartbeats from callers that never asked for a quorum, e.g. readiness probes: "
            f"{', '.join(status['other_callers'][:10])})"
        )
    lines += ["", "events (oldest first):"]
    lines += [
        f"  #{e['seq']:<6} {clock(e['time'])} {e['kind']:<18} {e['group'] or '-':<20} {e['reason']}"
        for e in events["events"]
    ]
    return "\n".join(lines) + "\n"


def state_loss_line(loss: dict) -> str:
    """The status page's and ``torchft_lighthouse status``'s line for ``/status.json``'s
    ``state_loss``."""
    holders = ", ".join(loss["holders"]) or "unknown"
    return (
        f"STATE LOST: no member holds the job's step {loss['lost_step']} (its holders "
        f"{holders} are gone); the groups stop or train on from an older state as their "
        'fault_tolerance.on_state_loss says (docs/operations.md, "State loss")'
    )
