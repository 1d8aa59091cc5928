"""Page-locked host memory for a GPU worker whose θ stays in host memory.

Where θ and the server's tensors stay in host memory while a worker computes on a GPU (`process` over several GPUs or
with `engine.theta_on_gpu=false`; a GPU worker of `distributed` under torchrun, whose gloo moves CPU tensors), each
commit copies θ and the server's tensors to the GPU (the staged view), the commit back to the host, and θ to the GPU
again (the pull). From pageable memory the driver copies through a staging buffer of its own: 12.7 GB/s host to
device on an H200, against 51.6 GB/s from the same shared memory once it is registered with CUDA (`cudaHostRegister`;
BENCHMARKS.md, "GPU workers"). So a GPU worker registers each host tensor it copies θ from, once, in place (θ stays
where the engine put it: shared memory, rank 0's window), and sends its commit back through page-locked buffers of
its own, reused from one commit to the next. Memory a worker allocates itself for θ (a remote worker's replica) is
allocated page-locked instead (`Server.pin_memory`): registering it in place could fail where two tensors of the C
heap share a page, which the driver registers once only.

Registration can fail (a platform without it, a mapping the driver refuses): the worker then says so once and copies
as before. The CUDA runtime keeps a failed call's error for the next caller to read, and torch reads it after its
next kernel launch, which would then fail for no reason of its own: a failure is read off at once here, by a kernel
launched for that purpose. What a worker registered it unregisters when its `Pinned` goes, before the memory can be
freed (the tensors are held until then).
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable

import torch

PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context, not only the current device's


def pinned_for(device: torch.device, who: str) -> Pinned | None:
    """A worker's page-locked memory where it computes on a GPU; None on the CPU, where nothing is copied."""
    return Pinned(device, who) if device.type == "cuda" else None


def _cuda_register(address: int, size: int, flags: int) -> int:
    return int(torch.cuda.cudart().cudaHostRegister(address, size, flags))


def _cuda_unregister(address: int) -> int:
    return int(torch.cuda.cudart().cudaHostUnregister(address))


def _is_pinned(t: torch.Tensor) -> bool:  # page-locked already: allocated so, or registered by another worker here
    return t.is_pinned()


def _unregister(held: dict, unregister: Callable[[int], int]) -> None:
    for address in list(held):
        try:
            unregister(address)
        except Exception:  # a process on its way out: nothing to do about it
            pass
    held.clear()


class Pinned:
    """One GPU worker's page-locked host memory: `host({name: tensor})` registers each host tensor it copies from
    (once, holding it until the `Pinned` goes, when it is unregistered); `out(key, like)` is a page-locked buffer of
    `like`'s shape and dtype, the same one for the same key at every commit."""

    def __init__(
        self,
        device: torch.device,
        who: str,
        register: Callable[[int, int, int], int] = _cuda_register,
        unregister: Callable[[int], int] = _cuda_unregister,
    ):
        self.device, self.who, self._register = device, who, register
        self.held: dict[int, torch.Tensor] = {}  # address → the registered tensor
        self._locked_already: set[int] = set()  # addresses page-locked by their allocation (not ours to undo)
        self.failed = False  # once registration has failed, this worker copies through pageable memory
        self._out: dict[str, torch.Tensor] = {}
        # no atexit: a worker's registrations end with its process
        weakref.finalize(self, _unregister, self.held, unregister).atexit = False

    def host(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            address = t.data_ptr()
            if (
                self.failed
                or t.device.type != "cpu"
                or not t.numel()
                or address in self.held
                or address in self._locked_already
                or not t.is_contiguous()
            ):  # θ and the server's tensors are flat
                continue
            if _is_pinned(t):
                self._locked_already.add(address)
                continue
            # on this worker's GPU, not in the current device's (GPU 0's) context
            with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
                err = self._register(address, t.nbytes, PORTABLE)
            if err:
                self._give_up(name, err)
                return
            self.held[address] = t

    def out(self, key: str, like: torch.Tensor) -> torch.Tensor:
        buf = self._out.get(key)
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = self._out[key] = torch.empty(
                like.shape, dtype=like.dtype, pin_memory=not self.failed and torch.cuda.is_available()
            )
        return buf

    def _give_up(self, name: str, err: int) -> None:
        self.failed = True
        what = "unknown"
        if self.device.type == "cuda":
            try:  # read the runtime's error off now (torch's launch check reads it), not at an unrelated kernel
                torch.empty(1, device=self.device).fill_(0)
            except RuntimeError:
                pass
            try:
                what = torch.cuda.cudart().cudaGetErrorString(torch.cuda.cudart().cudaError(err))
            except Exception:  # only the message's wording depends on it
                pass
        print(
            f"gem: {self.who}: the host memory of {name} could not be page-locked (cudaHostRegister: error {err}, "
            f"{what}); its copies to and from the GPU go through pageable memory, at about a quarter of the speed",
            file=sys.stderr,
            flush=True,
        )
