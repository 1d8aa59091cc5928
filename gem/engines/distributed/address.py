"""Who can reach the run. A local launch listens on loopback; another address (`engine.host=0.0.0.0`) lets anyone
who can reach it connect to the run, so it needs `engine.allow_remote=true`; only the launch's own workers, which
it hands the run's secret, can join it as workers (secret.admit). A launch over several machines needs the secret
in every rank's environment (GEM_RUN_SECRET). The address, an explicit `engine.port` and the secret are checked
before anything starts (check_address, called by the config's validation), and rank 0 binds its listening socket
the same way (`open_listener`)."""

from __future__ import annotations

import errno
import ipaddress
import socket
import sys

from gem.engines.distributed.group import launched
from gem.engines.distributed.secret import launched_secret


def check_address(host: str, port: int, allow_remote: bool) -> None:
    """engine=distributed: refuse, in one line (ValueError), an address a local launch must not or cannot listen
    on, before anything starts; print the warning for an exposed one (once). Under a launcher the addresses are
    the launcher's (MASTER_ADDR, MASTER_PORT), and what is checked is the run's secret, which a launch over
    several machines needs (secret.launched_secret)."""
    if launched():
        launched_secret()
        return
    warning = check_host(host, allow_remote)
    check_port(host, port)
    warn_once(warning)


def check_host(host: str, allow_remote: bool) -> str | None:
    """None for loopback (127.0.0.0/8, ::1, localhost); for any other address, the warning line to print when
    engine.allow_remote=true, else ValueError: whoever can reach rank 0's address can connect to the run, read its
    traffic and disturb it."""
    if _loopback(host):
        return None
    if not allow_remote:
        raise ValueError(
            f"engine.host={host} is not a loopback address, and anyone who can reach it could connect to "
            "the run and read its traffic; use engine.host=127.0.0.1 (or localhost, ::1), or set "
            "engine.allow_remote=true to expose the run on it"
        )
    where = f"every address of this machine ({host or 'all'})" if _any_address(host) else host
    return (
        f"gem: warning: engine.allow_remote=true: the run listens on {where}; anyone who can reach it can "
        "connect, and read or disturb its traffic (gloo's is neither authenticated nor encrypted), though only "
        "workers that prove the run's secret can join"
    )


def _loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:  # a host name: it may resolve to anything
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def _any_address(host: str) -> bool:
    return host in ("", "0.0.0.0", "::")


def local_address(host: str) -> str:
    """The address a local launch's ranks use for one another: the one rank 0 listens on, or loopback when it
    listens on every address (a connection needs one destination, and gloo one interface)."""
    if not _any_address(host):
        return host
    return "::1" if host == "::" else "127.0.0.1"


_warned: set[str] = set()  # each job of a sweep is validated, on the same host: one warning a process


def warn_once(line: str | None) -> None:
    if line and line not in _warned:
        _warned.add(line)
        print(line, file=sys.stderr, flush=True)


def check_port(host: str, port: int) -> None:
    """ValueError, in one line, when rank 0 could not listen on (host, port): the port is taken, or the host is
    not an address of this machine. It binds as rank 0 will (open_listener) and lets go at once. (SO_REUSEADDR as
    there: without it, a port that the previous run of a sweep used would be refused while its closed
    connections wait out TIME_WAIT, though rank 0 could listen on it.)"""
    open_listener(host, port).close()


def open_listener(host: str, port: int) -> socket.socket:
    """Rank 0's listening socket for the job's TCPStore (port 0: a free one). A bind that fails, here or when a
    port free when the command was checked has been taken since, is one line naming the key."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen(128)
    except OSError as e:
        s.close()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(
                f"engine.port={port} is in use on {host} (another run or program holds it); pick "
                "another port, or engine.port=0 for a free one"
            ) from None
        raise ValueError(
            f"engine.host={host} cannot be listened on ({e.strerror or e}); give an address of this "
            "machine, such as 127.0.0.1"
        ) from None
    return s
