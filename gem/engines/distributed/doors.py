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

What stays open: whatever reaches the ports in the seconds before the group has formed (a connection made then to
gloo's listener that closes before the handshake still costs a descriptor, and a value stored then stays), and
everything on a system without /proc/self/fd or SO_ATTACH_FILTER, where these do nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import os
import socket
import stat
import struct

SO_ATTACH_FILTER = 26  # <asm-generic/socket.h>; Python's socket module does not name it
# struct sock_filter {u16 code; u8 jt; u8 jf; u32 k}: BPF_RET | BPF_K, k = 0: keep 0 bytes of the packet
_KEEP_NOTHING = (ctypes.c_ubyte * 8).from_buffer_copy(struct.pack("=HBBI", 0x06, 0, 0, 0))
ENDPOINTS_BYTES = 256  # a worker's endpoints, JSON padded with spaces, after its proof (wire._prove)
MAX_ENDPOINTS = 4


@contextlib.contextmanager
def _tcp_sockets():
    """This process's TCP sockets, each as a socket object on a duplicate of its descriptor (closed after: the
    sockets themselves stay as they are, with their owners: gloo, the store, the caller)."""
    held = []
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:  # not Linux
        names = []
    try:
        for name in names:
            try:
                fd = int(name)
                if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                    continue
                copy = os.dup(fd)
            except (OSError, ValueError):  # closed meanwhile, or the listing's own descriptor
                continue
            try:
                s = socket.socket(fileno=copy)
            except OSError:
                os.close(copy)
                continue
            if s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6):
                held.append(s)
            else:
                s.close()
        yield held
    finally:
        for s in held:
            s.close()


def _listens(s: socket.socket) -> bool:
    return bool(s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))


def _endpoint(address) -> tuple[str, int]:
    """(address, port), an IPv4 address mapped into IPv6 written as IPv4: one socket's end, however its family
    shows it."""
    ip = ipaddress.ip_address(str(address[0]).split("%")[0])
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip), int(address[1])


def listening() -> frozenset[int]:
    """The listening sockets of this process now, by inode: what `refuse_newcomers` leaves alone."""
    with _tcp_sockets() as socks:
        return frozenset(os.fstat(s.fileno()).st_ino for s in socks if _listens(s))


def refuse_newcomers(before: frozenset[int]) -> list[int]:
    """Every socket this process listens on that `before` (listening(), taken before the group formed) did not
    hold refuses new connections from now on. Returns their ports. With TORCH_GLOO_LAZY_INIT gloo connects pairs
    at their first message, through these listeners: they are left open."""
    if os.environ.get("TORCH_GLOO_LAZY_INIT", "").lower() in ("1", "true"):
        return []
    program = struct.pack("@HP", 1, ctypes.addressof(_KEEP_NOTHING))  # struct sock_fprog {len; filter *}
    ports = []
    with _tcp_sockets() as socks:
        for s in socks:
            if _listens(s) and os.fstat(s.fileno()).st_ino not in before:
                try:
                    s.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, program)
                except OSError:  # no socket filters here
                    continue
                ports.append(s.getsockname()[1])
    return sorted(ports)


def held_endpoints(port: int | None) -> bytes:
    """A worker's connections to the job's store (at `port` on its host), as rank 0 sees their far ends: what it
    sends with its proof. ENDPOINTS_BYTES exactly."""
    ends = []
    if port:
        with _tcp_sockets() as socks:
            for s in socks:
                try:
                    if not _listens(s) and s.getpeername()[1] == port:
                        ends.append(list(_endpoint(s.getsockname())))
                except OSError:  # not connected
                    continue
    text = json.dumps(ends[:MAX_ENDPOINTS]).encode()
    return text.ljust(ENDPOINTS_BYTES) if len(text) <= ENDPOINTS_BYTES else b"[]".ljust(ENDPOINTS_BYTES)


def parse_endpoints(data: bytes) -> set[tuple[str, int]]:
    """What a worker sent as its endpoints; a peer's bytes, so anything but a short list of [address, port] is no
    endpoint at all (its store connections are then cut: it loses nothing else)."""
    try:
        ends = json.loads(data.decode())
        if not isinstance(ends, list) or len(ends) > MAX_ENDPOINTS:
            return set()
        return {_endpoint(e) for e in ends if isinstance(e, list) and len(e) == 2 and isinstance(e[0], str)
                and isinstance(e[1], int) and 0 < e[1] < 65536}
    except (UnicodeDecodeError, ValueError, TypeError):
        return set()


def cut_strangers(port: int | None, keep: set[tuple[str, int]]) -> list[str]:
    """Rank 0 holding the job's store on `port`: shut every connection to it whose far end is neither one of this
    process's sockets nor in `keep` (the admitted workers' endpoints). Returns the far ends cut. Does nothing where
    this process does not hold the store (under torchrun its agent does)."""
    cut: list[str] = []
    if not port:
        return cut
    with _tcp_sockets() as socks:
        if not any(_listens(s) and s.getsockname()[1] == port for s in socks):
            return cut
        own = {_endpoint(s.getsockname()) for s in socks}
        for s in socks:
            try:
                if _listens(s) or s.getsockname()[1] != port:
                    continue
                far = _endpoint(s.getpeername())
            except OSError:
                continue
            if far not in own and far not in keep:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)  # the store reads end of file and closes its side
                cut.append(f"{far[0]}:{far[1]}")
    return cut
