"""Page-locked host memory for a GPU worker whose θ stays in host memory.

Where θ and the server's tensors stay in host memory while a worker computes on a GPU (`process` over several GPUs
or with `engine.theta_on_gpu=false`; every GPU worker of `distributed`, whose gloo moves CPU tensors), each commit
copies θ and the server's tensors to the GPU (the staged view), the commit back to the host, and θ to the GPU again
(the pull). From pageable memory the driver copies through a staging buffer of its own: 12.7 GB/s host to device on
an H200, against 51.6 GB/s from the same shared memory once it is registered with CUDA (`cudaHostRegister`;
BENCHMARKS.md, "GPU workers"). So a GPU worker registers each host tensor it copies θ from, once, in place (θ stays
where the engine put it: shared memory, rank 0's window, the replica a remote worker receives into), and sends its
commit back through page-locked buffers of its own, reused from one commit to the next.

Registration can fail (a platform without it, a mapping the driver refuses): the worker then says so once and copies
as before. The CUDA runtime keeps a failed call's error for the next caller to read, and torch reads it after its
next kernel launch, which would then fail for no reason of its own: a failure is read off at once here, by a kernel
launched for that purpose.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

READ_ONLY = 8  # cudaHostRegisterReadOnly: memory mapped without write permission (a worker's view of rank 0's window)


def writable(address: int) -> bool:
    """Whether the mapping that holds `address` may be written (/proc/self/maps); True where that cannot be read."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                span, perms = line.split(maxsplit=2)[:2]
                low, high = (int(a, 16) for a in span.split("-"))
                if low <= address < high:
                    return perms[1] == "w"
    except (OSError, ValueError):
        pass
    return True


def pinned_for(device: torch.device, who: str) -> Pinned | None:
    """A worker's page-locked memory where it computes on a GPU; None on the CPU, where nothing is copied."""
    return Pinned(device, who) if device.type == "cuda" else None


def _cuda_register(address: int, size: int, flags: int) -> int:
    return int(torch.cuda.cudart().cudaHostRegister(address, size, flags))


class Pinned:
    """One GPU worker's page-locked host memory: `host(*tensors)` registers each host tensor it copies from (once,
    and keeps it, so that its memory is not freed while registered); `out(key, like)` is a page-locked buffer of
    `like`'s shape and dtype, the same one for the same key at every commit."""

    def __init__(self, device: torch.device, who: str, register: Callable[[int, int, int], int] = _cuda_register):
        self.device, self.who, self._register = device, who, register
        self.held: dict[int, torch.Tensor] = {}  # address → the registered tensor
        self.failed = False  # once registration has failed, this worker copies through pageable memory
        self._out: dict[str, torch.Tensor] = {}

    def host(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if self.failed or t.device.type != "cpu" or not t.numel() or t.data_ptr() in self.held:
                continue
            if not t.is_contiguous():  # θ and the server's tensors are flat; anything else is copied as it is
                continue
            flags = 0 if writable(t.data_ptr()) else READ_ONLY
            err = self._register(t.data_ptr(), t.nbytes, flags)
            if err:
                self._give_up(err)
                return
            self.held[t.data_ptr()] = t

    def out(self, key: str, like: torch.Tensor) -> torch.Tensor:
        buf = self._out.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = self._out[key] = torch.empty(like.shape, dtype=like.dtype, pin_memory=not self.failed and
                                               torch.cuda.is_available())
        return buf

    def _give_up(self, err: int) -> None:
        self.failed = True
        if self.device.type == "cuda":
            try:  # read the runtime's error off now (torch's launch check reads it), not at an unrelated kernel
                torch.empty(1, device=self.device).fill_(0)
            except RuntimeError:
                pass
        try:
            name = torch.cuda.cudart().cudaGetErrorString(torch.cuda.cudart().cudaError(err))
        except (AttributeError, RuntimeError, TypeError, ValueError):
            name = "unknown"
        print(f"gem: {self.who}: θ's host memory could not be page-locked (cudaHostRegister: error {err}, {name}); "
              "its copies to and from the GPU go through pageable memory, at about a quarter of the speed",
              file=sys.stderr, flush=True)
