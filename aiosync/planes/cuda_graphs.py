"""A batch of device copies as one CUDA graph: built once, launched with one call.

Where the same copies recur every version (a direct bucket's reads of a trainer's
regions), queueing them one ``cudaMemcpyAsync`` at a time costs host time per copy, and on
one stream each copy waits for the last wave of the one before it. A :class:`CopyGraph`
holds the copies as memcpy nodes of one graph, in chains (each copy's chain given; each
chain in order, the chains independent of each other; none given: every copy
independent), and queues all of them with one ``cudaGraphLaunch``. To other work on the
stream it is launched on, the graph is one step: it starts after what was queued before
and what is queued after starts after all of it.

The addresses are fixed when the graph is built: the owner makes another when they change.
A graph is destroyed by :meth:`CopyGraph.close` or when it is garbage (a launch still in
flight completes either way).
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Sequence

import torch

from aiosync.planes.cuda_runtime import MEMCPY_DEFAULT, check_cuda, runtime

CopyJob = tuple[int, int, int]
"""One copy: destination address, source address, bytes."""

_bound = threading.Lock()
_signatures_set = False


def _graph_runtime() -> ctypes.CDLL:
    """The runtime library with the graph functions' argument types declared (once)."""
    global _signatures_set
    lib = runtime()
    with _bound:
        if not _signatures_set:
            lib.cudaGraphCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
            lib.cudaGraphAddMemcpyNode1D.argtypes = [
                ctypes.POINTER(ctypes.c_void_p),
                ctypes.c_void_p,
                ctypes.POINTER(ctypes.c_void_p),
                ctypes.c_size_t,
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_size_t,
                ctypes.c_int,
            ]
            lib.cudaGraphInstantiateWithFlags.argtypes = [
                ctypes.POINTER(ctypes.c_void_p),
                ctypes.c_void_p,
                ctypes.c_ulonglong,
            ]
            lib.cudaGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
            lib.cudaGraphExecDestroy.argtypes = [ctypes.c_void_p]
            lib.cudaGraphDestroy.argtypes = [ctypes.c_void_p]
            _signatures_set = True
    return lib


def _destroy(made: int | None, graph: int | None) -> None:
    lib = _graph_runtime()
    if made is not None:
        lib.cudaGraphExecDestroy(ctypes.c_void_p(made))
    if graph is not None:
        lib.cudaGraphDestroy(ctypes.c_void_p(graph))


class CopyGraph:
    """``jobs`` as one instantiated graph on ``device``, job ``i`` in chain ``chains[i]``.

    ``chains`` None: every copy independent of the others.
    """

    def __init__(
        self, jobs: Sequence[CopyJob], device: int, chains: Sequence[int] | None = None
    ) -> None:
        lib = _graph_runtime()
        self.device = device
        self.jobs = len(jobs)
        self._exec: int | None = None
        with torch.cuda.device(device):
            graph = ctypes.c_void_p()
            check_cuda(lib.cudaGraphCreate(ctypes.byref(graph), 0), "cudaGraphCreate")
            try:
                _add_copies(lib, graph, jobs, chains)
                made = ctypes.c_void_p()
                code = lib.cudaGraphInstantiateWithFlags(ctypes.byref(made), graph, 0)
                check_cuda(code, "cudaGraphInstantiateWithFlags")
            finally:
                _destroy(None, graph.value)  # the instantiated graph stands alone
        self._exec = made.value
        self._finalizer = weakref.finalize(self, _destroy, made.value, None)

    def launch(self, stream: torch.cuda.Stream) -> None:
        """Queue every copy on ``stream`` (on this graph's device); no host wait."""
        if self._exec is None:
            raise RuntimeError("the copy graph is closed")
        code = _graph_runtime().cudaGraphLaunch(
            ctypes.c_void_p(self._exec), ctypes.c_void_p(stream.cuda_stream)
        )
        check_cuda(code, "cudaGraphLaunch")

    def close(self) -> None:
        """Destroy the graph (idempotent); launches already queued still run."""
        self._exec = None
        self._finalizer()


def _add_copies(
    lib: ctypes.CDLL, graph: ctypes.c_void_p, jobs: Sequence[CopyJob], chains: Sequence[int] | None
) -> None:
    """One memcpy node a job, after the last node of its chain (none given: no edges)."""
    if chains is not None and len(chains) != len(jobs):
        raise ValueError(f"{len(chains)} chains given for {len(jobs)} copies")
    ends: dict[int, ctypes.c_void_p] = {}
    for k, (dst, src, nbytes) in enumerate(jobs):
        node = ctypes.c_void_p()
        last = ends.get(chains[k]) if chains is not None else None
        code = lib.cudaGraphAddMemcpyNode1D(
            ctypes.byref(node),
            graph,
            ctypes.byref(last) if last is not None else None,
            1 if last is not None else 0,
            ctypes.c_void_p(dst),
            ctypes.c_void_p(src),
            nbytes,
            MEMCPY_DEFAULT,
        )
        check_cuda(code, "cudaGraphAddMemcpyNode1D")
        if chains is not None:
            ends[chains[k]] = node
