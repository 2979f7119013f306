"""The flags ``queueserve gateway`` and ``queueserve dashboard`` share for their connections and
the browser origins that may write (queueserve/gateway/connections.py, crosssite.py). Here, not
there: the CLI builds its parser without the gateway extra (uvicorn) installed."""

from __future__ import annotations

import argparse

from queueserve.options.units import parse_duration


def _positive_duration(value: str) -> float:
    try:
        seconds = parse_duration(value)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 (for example 10s), got {value!r}")
    return seconds


def _positive_int(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value!r}")
    return int(value)


def _cap(value: str) -> int:
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"must be an integer >= 0 (0: no cap), got {value!r}")
    return int(value)


def add_connection_options(
    p: argparse.ArgumentParser, env: str, keep_alive: str, most: int, per_client: int
) -> None:
    """The connection guard's flags (queueserve/gateway/connections.py, whose defaults the help
    repeats) and --allow-origin (crosssite.py); left out, each is ``<env>_<NAME>``, else the
    default."""
    p.add_argument(
        "--header-timeout",
        type=_positive_duration,
        help=f"close a connection whose request head has not arrived within this (${env}"
        "_HEADER_TIMEOUT, else 10s)",
    )
    p.add_argument(
        "--body-timeout",
        type=_positive_duration,
        help=f"close one whose request body has not arrived within this of its head (${env}"
        "_BODY_TIMEOUT, else 30s)",
    )
    p.add_argument(
        "--keep-alive-timeout",
        type=_positive_duration,
        help=f"close a kept-alive connection idle this long between requests (${env}"
        f"_KEEP_ALIVE_TIMEOUT, else {keep_alive})",
    )
    p.add_argument(
        "--max-connections",
        type=_positive_int,
        help=f"connections held at once; one more replaces the one waiting longest on its "
        f"client (${env}_MAX_CONNECTIONS, else {most})",
    )
    p.add_argument(
        "--max-connections-per-client",
        type=_cap,
        help=f"connections one client address may hold; 0: no cap (behind a proxy, every "
        f"connection is the proxy's) (${env}_MAX_CONNECTIONS_PER_CLIENT, else "
        f"{per_client})",
    )
    p.add_argument(
        "--allow-origin",
        action="append",
        metavar="ORIGIN",
        help="a browser origin (https://app.example.com; * for any) whose pages may write "
        f"besides the server's own (repeatable; ${env}_ALLOW_ORIGIN, comma-separated)",
    )
