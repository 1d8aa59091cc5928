"""Hosts on one machine: Linux network namespaces joined by veth links, each with its own address, for tests and
benchmarks of engine=distributed across hosts (tests/test_multihost.py). Needs root and iproute2 (`ip`, `tc`).

    with Hosts(2) as hosts:                   # namespaces gemt<pid>x<k>n0, ...n1; 10.213.0.1 and 10.213.0.2
        p = hosts.popen(1, ["python", "-c", "..."], env=...)   # runs in host 1's namespace (ip netns exec)
        hosts.shape(1000)                     # tbf at 1 Gbit/s on both ends of every link
        hosts.shape(3000, hosts=[1])          # ... then host 1's link (both its ends) at 3 Gbit/s
        hosts.link_bytes(0)                   # (rx, tx) bytes of host 0's link so far

Two hosts share one veth pair; more are joined through a bridge in a hub namespace of their own. Nothing is made in
the machine's own namespace. `close` (and leaving the `with`) kills every process in the namespaces (`ip netns pids`,
whoever started it) and deletes them, which deletes their links; namespaces of the same prefix left by a
process that is no longer alive (a test killed before its cleanup) are deleted when the next `Hosts` starts.

Shaping: `tbf` on both ends of a link shapes what each end sends, so both directions run at the rate. It counts
whole Ethernet frames, so TCP carries at most 1448/1514 = 0.956 of the rate (MTU 1500, timestamps on). Its bucket
(`burst`) holds 4 ms at the rate, and at least 128 KiB: the qdisc is woken by a timer, and a bucket smaller than
what the link carries between two wake-ups lowers the rate it reaches (on this 2-core machine under a load of 4, a
1 ms bucket, 1.25 MB, gave 7.6 to 8.6 Gbit/s of TCP at 10 Gbit/s; 2 ms 8.5 to 9.3; 4 ms 9.2 to 9.6, the 9.56 that
framing allows); below 64 KiB it would also cut veth's GSO packets into segments. 4 ms is 500 KB at 1 Gbit/s and
5 MB at 10 Gbit/s. After an idle spell the bucket is full and that much goes at the link's own speed: a transfer
shorter than a few buckets, or a link idle most of the time, is not held to the rate. `latency` bounds the queue
behind the bucket (rate x latency).

    python tests/helpers/netns.py [--rate MBIT ...] [--mbytes 200]   # measures TCP transfers between two namespaces
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

PREFIX = "gemt"
SUBNET = "10.213.0"  # a private /24; each set of hosts lives in namespaces of its own, so sets never clash
BUCKET_S = 0.004  # tbf's bucket, in seconds at the rate (the module says why)
_made = 0  # Hosts made by this process: part of the namespaces' names


def bucket_bytes(rate_mbit: float) -> int:
    """tbf's bucket (`burst`) at a rate, unless `shape` is given another: the module says why."""
    return max(int(rate_mbit * 1e6 / 8 * BUCKET_S), 128 * 1024)


class Unavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no `ip`, or `ip netns add` refused): the reason."""


@dataclass
class Host:
    ns: str  # the namespace's name
    ifname: str  # its link's interface (GLOO_SOCKET_IFNAME)
    addr: str  # its address on that link


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and p.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {p.stderr.strip()}")
    return p


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(prefix: str = PREFIX) -> list[str]:
    """Delete the namespaces named <prefix><pid>x... whose pid is no longer alive, and kill what runs in them;
    their names."""
    out = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(rf"{re.escape(prefix)}(\d+)x\w+", name)
        if m and not _alive(int(m.group(1))):
            for pid in _ip("netns", "pids", name, check=False).stdout.split():  # what its test left running
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _ip("netns", "del", name, check=False)
            out.append(name)
    return out


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not on PATH"
    return None


class Hosts:
    """n hosts, each a network namespace with one link and one address in SUBNET (.1, .2, ...); see the module."""

    def __init__(self, n: int = 2, rate_mbit: float | None = None, prefix: str = PREFIX, subnet: str = SUBNET):
        global _made
        if n < 2:
            raise ValueError("Hosts needs at least 2 hosts")
        why = available()
        if why:
            raise Unavailable(why)
        remove_stale(prefix)
        _made += 1
        base = f"{prefix}{os.getpid()}x{_made}"
        self.hosts = [Host(f"{base}n{i}", f"gem{i}", f"{subnet}.{i + 1}") for i in range(n)]
        self.hub = f"{base}hub" if n > 2 else None
        self.made: list[str] = []  # namespaces made so far: what close deletes
        self.procs: list[subprocess.Popen] = []
        try:
            self._make()
            if rate_mbit:
                self.shape(rate_mbit)
        except BaseException:
            self.close()
            raise

    def _add(self, ns: str) -> None:
        p = _ip("netns", "add", ns, check=False)
        if p.returncode:
            raise Unavailable(f"`ip netns add` failed: {p.stderr.strip()}")
        self.made.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def _make(self) -> None:
        for h in self.hosts:
            self._add(h.ns)
        if self.hub is None:  # two hosts: one veth pair
            a, b = self.hosts
            _ip("-n", a.ns, "link", "add", a.ifname, "type", "veth", "peer", "name", b.ifname, "netns", b.ns)
        else:  # a bridge in the hub, one veth pair from it to each host
            self._add(self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for i, h in enumerate(self.hosts):
                _ip("-n", self.hub, "link", "add", f"hub{i}", "type", "veth", "peer", "name", h.ifname, "netns", h.ns)
                _ip("-n", self.hub, "link", "set", f"hub{i}", "master", "br0", "up")
        for h in self.hosts:
            _ip("-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", h.ifname)
            _ip("-n", h.ns, "link", "set", h.ifname, "up")

    def ends(self, hosts: list[int] | None = None) -> list[tuple[str, str]]:
        """(namespace, interface) of both ends of every link, or of the links of `hosts` (their indices); two hosts
        share one link, so either one's is both ends of it."""
        if self.hub is None:
            return [(h.ns, h.ifname) for h in self.hosts]
        which = range(len(self.hosts)) if hosts is None else hosts
        return [(self.hosts[i].ns, self.hosts[i].ifname) for i in which] + [(self.hub, f"hub{i}") for i in which]

    def shape(
        self, rate_mbit: float, burst_bytes: int | None = None, latency_ms: float = 10.0, hosts: list[int] | None = None
    ) -> None:
        """tbf at rate_mbit on both ends of every link, or of the links of `hosts` only (a host whose link must not
        be the limit gets a rate of its own), replacing any earlier shaping there; burst: see the module."""
        burst = burst_bytes or bucket_bytes(rate_mbit)
        for ns, dev in self.ends(hosts):
            p = subprocess.run(
                [
                    "tc",
                    "-n",
                    ns,
                    "qdisc",
                    "replace",
                    "dev",
                    dev,
                    "root",
                    "tbf",
                    "rate",
                    f"{rate_mbit}mbit",
                    "burst",
                    str(burst),
                    "latency",
                    f"{latency_ms}ms",
                ],
                capture_output=True,
                text=True,
                timeout=30,
            )
            if p.returncode:
                raise RuntimeError(f"tc on {ns}/{dev}: {p.stderr.strip()}")

    def argv(self, i: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[i].ns, *argv]

    def popen(self, i: int, argv: list[str], **kw) -> subprocess.Popen:
        """argv in host i's namespace (`ip netns exec` becomes argv), in a session of its own. Everything in the
        namespace is killed at close."""
        p = subprocess.Popen(self.argv(i, argv), start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def link_bytes(self, i: int) -> tuple[int, int]:
        """(received, sent) bytes of host i's link so far."""
        h = self.hosts[i]
        stats = json.loads(_ip("-n", h.ns, "-s", "-j", "link", "show", "dev", h.ifname).stdout)[0]["stats64"]
        return stats["rx"]["bytes"], stats["tx"]["bytes"]

    def pids(self, ns: str) -> list[int]:
        """Every process in namespace ns (whatever started it, and whatever session it made)."""
        return [int(x) for x in _ip("netns", "pids", ns, check=False).stdout.split()]

    def kill_host(self, i: int, timeout_s: float = 30.0) -> list[int]:
        """SIGKILL every process in host i's namespace, as if the machine lost power: killing a launcher's process
        group is not enough (torchrun starts each rank in a session of its own). The pids killed."""
        return self._kill_ns(self.hosts[i].ns, timeout_s)

    def _kill_ns(self, ns: str, timeout_s: float) -> list[int]:
        killed: list[int] = []
        deadline = time.monotonic() + timeout_s
        while (pids := self.pids(ns)) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
            for p in self.procs:  # reap our own, so that they do not linger as zombies in the namespace's list
                p.poll()
            time.sleep(0.05)
        return sorted(set(killed))

    def close(self) -> None:
        for ns in self.made:
            self._kill_ns(ns, 30.0)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                pass
        self.procs = []
        for ns in reversed(self.made):  # deleting a namespace deletes its end of each veth pair, and so the pair
            _ip("netns", "del", ns, check=False)
        self.made = []

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------------------------ a TCP transfer

_RECEIVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); n, want, buf = 0, int(sys.argv[2]), bytearray(1 << 20)
while n < want:
    k = c.recv_into(buf)
    if not k:
        break
    n += k
c.sendall(b"k"); print(n, flush=True)
"""

_SENDER = """
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2]))); want, chunk = int(sys.argv[3]), bytes(1 << 20)
t0 = time.perf_counter(); sent = 0
while sent < want:
    sent += c.send(chunk[:min(len(chunk), want - sent)])
c.recv(1); print(time.perf_counter() - t0, flush=True)
"""


def transfer_s(hosts: Hosts, src: int, dst: int, nbytes: int, timeout_s: float = 120.0) -> float:
    """Seconds to send nbytes over TCP from host src to host dst, until dst has them all (one connection)."""
    rx = hosts.popen(
        dst, [sys.executable, "-c", _RECEIVER, hosts.hosts[dst].addr, str(nbytes)], stdout=subprocess.PIPE, text=True
    )
    port = rx.stdout.readline().strip()
    tx = hosts.popen(
        src,
        [sys.executable, "-c", _SENDER, hosts.hosts[dst].addr, port, str(nbytes)],
        stdout=subprocess.PIPE,
        text=True,
    )
    out, _ = tx.communicate(timeout=timeout_s)
    got = int(rx.communicate(timeout=timeout_s)[0].strip())
    if tx.returncode or got != nbytes:
        raise RuntimeError(f"transfer failed: sender exit {tx.returncode}, {got} of {nbytes} bytes received")
    return float(out.strip())


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="TCP transfer rates between two namespaces, unshaped and shaped")
    ap.add_argument("--rate", type=float, nargs="*", default=[1000, 10000], help="tbf rates to try, Mbit/s")
    ap.add_argument("--burst", type=int, default=None, help="tbf burst in bytes (default: see tests/helpers/netns.py)")
    ap.add_argument("--mbytes", type=float, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    nbytes = int(a.mbytes * 1e6)
    with Hosts(2) as hosts:
        for rate in [None, *a.rate]:
            if rate:
                hosts.shape(rate, a.burst)
            times = [transfer_s(hosts, 1, 0, nbytes) for _ in range(a.repeats)]
            gbits = [nbytes * 8 / t / 1e9 for t in times]
            expect = f", expected {nbytes * 8 / (rate * 1e6):.3f} s" if rate else ""
            print(
                f"{'unshaped' if not rate else f'tbf {rate:g} Mbit/s'}: {a.mbytes:g} MB in "
                f"{', '.join(f'{t:.3f}' for t in times)} s{expect}; {', '.join(f'{g:.2f}' for g in gbits)} Gbit/s",
                flush=True,
            )


if __name__ == "__main__":
    main()
