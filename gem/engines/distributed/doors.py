"""Once a rank's group has formed, nobody new reaches it (on Linux).

While the group forms, a rank listens on two kinds of port: gloo's (every rank) and the job's store's (rank 0 in a
local launch and under SLURM; torchrun's agent holds it under torchrun). Once the group has formed, neither has
anyone left to accept, but torch keeps both open for the group's life, with two holes of its own: gloo's listener
loses a file descriptor for every connection that closes before gloo's handshake (a rank at its descriptor limit
aborts), and the store keeps whatever anyone connected to it stores there. So:

- `refuse_newcomers`: the listening sockets a rank opened while its group formed get a socket filter that keeps no
  packet (SO_ATTACH_FILTER: one classic BPF instruction, "return 0"). The kernel drops a newcomer's SYN before
  anything is accepted or allocated; connections made before are untouched (an accepted socket took its
  listener's filter, none, when it was made). A newcomer's connect times out.
- `cut_strangers`: rank 0, once its workers have proved the run's secret, shuts every connection to its store
  that neither it nor an admitted worker holds (each worker names its own with its proof: `held_endpoints`).
  A worker's address as it sees it must be the one rank 0 sees: through NAT (port forwarding, a container
  bridge between nodes) rank 0 would cut its workers' store connections, and say so.

- `empty_store`: rank 0, at the same moment, deletes every key in its store that torch's client can name: what a
  stranger stored there through torch's client before it was cut is given back (one speaking the store's protocol
  itself can store keys torch cannot name: rank 0 says how many stay).

What stays open: what reaches gloo's ports before the group has formed (a connection that closes before the
handshake still costs a descriptor) and the store before the workers have proved the secret (a value stored then
stays until they have); everything with TORCH_GLOO_LAZY_INIT, whose pairs connect through the listeners at their
first message; and everything on a system other than Linux, where these do nothing.

The sockets are torch's and gloo's: they are read and changed through their descriptors with libc's own calls
(ctypes), never wrapped in Python socket objects, which would change a descriptor's blocking mode for everyone
that shares it (wherever socket.setdefaulttimeout is set).
"""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import json
import os
import socket
import sys

LINUX = sys.platform.startswith("linux")
SO_ATTACH_FILTER = 26  # <asm-generic/socket.h>; Python's socket module does not name it
ENDPOINTS_BYTES = 512  # a worker's store endpoints, JSON padded with spaces, after its proof (secret.prove)
MAX_ENDPOINTS = 8


class _SockFilter(ctypes.Structure):  # struct sock_filter, <linux/filter.h>
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):  # struct sock_fprog
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


_KEEP_NOTHING = (_SockFilter * 1)(_SockFilter(0x06, 0, 0, 0))  # BPF_RET | BPF_K, k = 0: keep 0 bytes of the packet
_PROGRAM = _SockFprog(1, _KEEP_NOTHING)
_libc = ctypes.CDLL(None, use_errno=True) if LINUX else None


def _int_option(fd: int, option: int) -> int | None:
    value, size = ctypes.c_int(0), ctypes.c_uint32(ctypes.sizeof(ctypes.c_int))
    if _libc.getsockopt(fd, socket.SOL_SOCKET, option, ctypes.byref(value), ctypes.byref(size)) != 0:
        return None
    return value.value


def _address(call, fd: int) -> tuple[str, int] | None:
    """getsockname or getpeername of `fd`, as (address, port); None if it has none (not connected)."""
    buf, size = ctypes.create_string_buffer(128), ctypes.c_uint32(128)
    if call(fd, buf, ctypes.byref(size)) != 0:
        return None
    raw = buf.raw
    family, port = int.from_bytes(raw[0:2], sys.byteorder), int.from_bytes(raw[2:4], "big")
    if family == socket.AF_INET:
        return _endpoint((socket.inet_ntop(socket.AF_INET, raw[4:8]), port))
    if family == socket.AF_INET6:
        return _endpoint((socket.inet_ntop(socket.AF_INET6, raw[8:24]), port))
    return None


def _endpoint(address) -> tuple[str, int]:
    """(address, port), an IPv4 address mapped into IPv6 written as IPv4: one socket's end, however its family
    shows it."""
    ip = ipaddress.ip_address(str(address[0]).split("%")[0])
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(address[1])


class _Unseen:
    """What `_tcp_sockets` could not look at: sockets it could not duplicate, or the whole list (no descriptor left
    to read /proc/self/fd with)."""

    count = 0
    listing = False


def _tcp_sockets(unseen: _Unseen | None = None):
    """For each TCP socket of this process, one at a time: (descriptor, inode, listening, local end, far end). The
    descriptor is a duplicate, closed once the caller has moved on, and its inode is checked against the one the
    listing named: a socket closed meanwhile is not confused with one that took its number."""
    if not LINUX:
        return
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        if unseen is not None:
            unseen.listing = True
        return
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile, or the listing's own descriptor
            continue
        if not link.startswith("socket:["):
            continue
        try:
            fd = os.dup(int(name))
        except OSError:
            if unseen is not None:
                unseen.count += 1
            continue
        try:
            inode = int(link[8:-1])
            if os.fstat(fd).st_ino != inode:  # the number was closed and taken again since the listing
                continue
            local = _address(_libc.getsockname, fd)
            if local is None or _int_option(fd, socket.SO_TYPE) != socket.SOCK_STREAM:
                continue
            yield fd, inode, bool(_int_option(fd, socket.SO_ACCEPTCONN)), local, _address(_libc.getpeername, fd)
        finally:
            os.close(fd)


def listening() -> frozenset[int]:
    """The listening sockets of this process now, by inode: what `refuse_newcomers` leaves alone."""
    return frozenset(inode for _, inode, listens, _, _ in _tcp_sockets() if listens)


def lazy_gloo() -> bool:
    """TORCH_GLOO_LAZY_INIT, read as torch reads a boolean setting."""
    return os.environ.get("TORCH_GLOO_LAZY_INIT", "").strip().lower() in ("1", "y", "yes", "t", "true")


def refuse_newcomers(before: frozenset[int]) -> list[int]:
    """Every socket this process listens on that `before` (listening(), taken before the group formed) did not
    hold refuses new connections from now on. Returns their ports; a listener it could not reach is one line on
    stderr. With TORCH_GLOO_LAZY_INIT gloo connects pairs at their first message, through these listeners: they
    are left open."""
    if lazy_gloo():
        return []
    ports, unseen = [], _Unseen()
    for fd, inode, listens, local, _ in _tcp_sockets(unseen):
        if listens and inode not in before:
            if (
                _libc.setsockopt(
                    fd, socket.SOL_SOCKET, SO_ATTACH_FILTER, ctypes.byref(_PROGRAM), ctypes.sizeof(_PROGRAM)
                )
                != 0
            ):
                print(
                    f"gem: port {local[1]} still takes new connections ({os.strerror(ctypes.get_errno())})",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            ports.append(local[1])
    if unseen.listing:
        print(
            "gem: this process's descriptors could not be listed (no descriptor left); its listeners still take "
            "new connections",
            file=sys.stderr,
            flush=True,
        )
    elif unseen.count:
        print(
            f"gem: {unseen.count} socket(s) of this process could not be looked at (no descriptor left); any "
            "listener among them still takes new connections",
            file=sys.stderr,
            flush=True,
        )
    return sorted(ports)


def held_endpoints(port: int | None) -> bytes:
    """A worker's connections to the job's store (at `port`), as rank 0 sees their far ends: what it sends with
    its proof. ENDPOINTS_BYTES exactly."""
    ends = [
        list(local)
        for _, _, listens, local, far in _tcp_sockets()
        if port and not listens and far is not None and far[1] == port
    ]
    text = json.dumps(ends[:MAX_ENDPOINTS]).encode()
    return text.ljust(ENDPOINTS_BYTES) if len(text) <= ENDPOINTS_BYTES else b"[]".ljust(ENDPOINTS_BYTES)


def parse_endpoints(data: bytes) -> set[tuple[str, int]]:
    """What a worker sent as its endpoints; a peer's bytes, so anything but a short list of [address, port] is no
    endpoint at all (its store connections are then cut: it loses nothing else)."""
    try:
        ends = json.loads(data.decode())
        if not isinstance(ends, list) or len(ends) > MAX_ENDPOINTS:
            return set()
        return {
            _endpoint(e)
            for e in ends
            if isinstance(e, list) and len(e) == 2 and isinstance(e[0], str) and type(e[1]) is int and 0 < e[1] < 65536
        }
    except (UnicodeDecodeError, ValueError, TypeError, RecursionError):
        return set()


def _holds_store(port: int | None, sockets: list) -> bool:
    return bool(port) and any(listens and local[1] == port for _, _, listens, local, _ in sockets)


def cut_strangers(port: int | None, keep: set[tuple[str, int]]) -> list[str]:
    """Rank 0 holding the job's store on `port`: shut every connection to it whose far end is neither one of this
    process's own store clients nor in `keep` (the admitted workers' endpoints). Returns the far ends cut. Does
    nothing where this process does not hold the store (under torchrun its agent does)."""
    sockets = list(_tcp_sockets())  # their descriptors are closed by now: to know who is who
    if not _holds_store(port, sockets):
        return []
    own = {local for _, _, listens, local, far in sockets if not listens and far is not None and far[1] == port}
    strangers = {
        inode
        for _, inode, listens, local, far in sockets
        if not listens and local[1] == port and far is not None and far not in own and far not in keep
    }
    cut = []
    for fd, inode, _, _, far in _tcp_sockets():
        # the store reads end of file and closes its side (ENOTCONN: the far end had gone already)
        if inode in strangers and (_libc.shutdown(fd, socket.SHUT_RDWR) == 0 or ctypes.get_errno() == errno.ENOTCONN):
            cut.append(f"{far[0]}:{far[1]}")
    return cut


def empty_store(store, port: int | None) -> int:
    """Rank 0 holding the job's store on `port`, once its workers are admitted: delete every key that torch's client
    can name (a raw client's it cannot: it says how many stay), and what anyone stored there goes with them. The
    group's formation, torch's only use of the store, is over by then (each admitted worker proved the secret
    through its group); gem's own keys come later. Returns how many keys were deleted. Does nothing where this
    process does not hold the store (torchrun's agent keeps its rendezvous there), with TORCH_GLOO_LAZY_INIT
    (gloo's pairs connect later, through those keys), or where torch's store cannot list its keys (said on
    stderr: torch before TCPStore.list_keys)."""
    if lazy_gloo() or not _holds_store(port, list(_tcp_sockets())):
        return 0
    if not hasattr(store, "list_keys"):
        print(
            "gem: rank 0 cannot empty the job's store of what was stored before its workers were admitted (this "
            "torch's store cannot list its keys: a newer torch's can); it stays for the run",
            file=sys.stderr,
            flush=True,
        )
        return 0
    try:
        deleted = sum(bool(store.delete_key(key)) for key in store.list_keys())
        # torch's client names keys under a prefix of its own; its store's "init/" and what a client speaking the
        # store's protocol itself stored outside that prefix, it can neither list nor delete
        unnamed = store.num_keys() - 1
    except (RuntimeError, NotImplementedError) as e:
        print(
            f"gem: rank 0 could not empty the job's store of what was stored before its workers were admitted "
            f"({type(e).__name__}: {e}); it stays for the run",
            file=sys.stderr,
            flush=True,
        )
        return 0
    if unnamed > 0:
        print(
            f"gem: rank 0's store keeps {unnamed} key(s) that torch's client can neither name nor delete, stored "
            "before the workers were admitted by a client that speaks the store's protocol itself; they stay for "
            "the run",
            file=sys.stderr,
            flush=True,
        )
    trim = getattr(_libc, "malloc_trim", None)  # glibc: the freed values' pages back to the system, not only to
    if deleted and trim is not None:  # malloc's free lists (values of a few MiB come from its heap, not mmap)
        trim(0)
    return deleted
