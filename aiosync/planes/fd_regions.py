"""Direct mode over CUDA memory without legacy IPC handles: regions passed as file descriptors.

Under ``expandable_segments:True`` torch maps each tensor into physical allocations of
its own choosing (pages of 2 or 20 MiB, :mod:`aiosync.planes.cuda_vmm`), which
``cudaIpcGetMemHandle`` refuses. A tensor there is read directly all the same:

- **Trainer** (:class:`FdRegions`, one per direct sender plane on CUDA): a tensor's region
  is the run of physical allocations it lies in (:func:`span_pieces`: one mapping query an
  allocation, at split time only), named on the wire as a
  :class:`~aiosync.core.plane_specs.CudaFdRegion` (an ident that one sender never reuses,
  and each allocation's size), so a tensor never crosses its region's end. Tensors over
  the same allocations share a region (the small ones of one page); neighbours over
  different runs have regions of their own, which may share an allocation at their ends
  (an engine then maps it once a region). Regions are kept by their pieces (mapping base,
  size and the driver's allocation id, unique in the process), so memory remapped at the
  same address is a new region. One allocation of each is exported on the spot, once, so
  memory that cannot be is packed (and the report says why) rather than refused by every
  engine.
- **Serving** (:class:`~aiosync.planes.fd_passing.FdServer`, its thread started by the
  first region): an engine asks for a region's descriptors by ident; each piece is
  checked to be still the allocation the region named (before and after its export),
  exported (``cuMemExportToShareableHandle``) and sent, then closed here. Regions of a
  split made afresh replace the last split's (:meth:`FdRegions.retain`).
- **Engine** (:func:`check_fd_region`, :func:`open_fd_region`): bounds the pieces, fetches
  the descriptors from the trainer of its hello, checks their sizes against the region,
  maps them back to back (read-only where the driver allows) and closes every descriptor.

Whether a region still holds its tensor is one query a piece (:meth:`FdRegions.still`);
:mod:`aiosync.planes.direct_regions` skips it while torch's allocator vouches for the pages.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Iterable

from aiosync.core.errors import AiosyncError, ProtocolError
from aiosync.core.plane_specs import CudaFdRegion, DescriptorSource, Region
from aiosync.planes.cuda_vmm import (
    POSIX_FD,
    ImportedMemory,
    Imports,
    Mapping,
    MappingQuery,
    export_fd,
    serve_device,
)
from aiosync.planes.fd_passing import MAX_PIECES, FdServer, fetch_fds

NO_LEGACY = "its memory has no legacy CUDA IPC handle"
NO_MAPPING = f"{NO_LEGACY}, and the driver does not describe its mapping"
NO_FD_EXPORT = f"{NO_LEGACY} and cannot be exported as a file descriptor"
TOO_MANY_PIECES = f"spread over more than {MAX_PIECES} physical allocations"

Pieces = tuple[Mapping, ...]
"""A region as the trainer keeps it: its physical allocations, in address order."""


def span_pieces(pointer: int, nbytes: int, query: Callable[[int], Mapping | None]) -> Pieces | str:
    """The physical allocations ``nbytes`` at ``pointer`` lie in, in order; or why not.

    ``query`` answers the allocation mapped at an address (:class:`~aiosync.planes.
    cuda_vmm.MappingQuery`); each must start where the one before ends and be exportable
    as a file descriptor.
    """
    pieces: list[Mapping] = []
    at, end = pointer, pointer + max(nbytes, 1)
    while at < end:
        found = query(at)
        if found is None:
            return NO_MAPPING
        if pieces and found.base != at:
            return f"{NO_LEGACY}, and its mappings are not one after another"
        if not found.handle_types & POSIX_FD:
            return NO_FD_EXPORT
        if len(pieces) == MAX_PIECES:
            return TOO_MANY_PIECES
        pieces.append(found)
        at = found.base + found.size
    return tuple(pieces)


def pieces_of(region: Region) -> int:
    """Physical allocations an engine maps to open ``region`` (0: not a descriptor region)."""
    return len(region.pieces) if isinstance(region, CudaFdRegion) else 0


class CudaAllocations:
    """The driver's answers about this process's physical allocations on ``device``.

    What :class:`FdRegions` asks (tests stand in for it with allocations over plain files).
    """

    def __init__(self, device: int) -> None:
        self.device = device

    def query(self) -> Callable[[int], Mapping | None]:
        """A mapping query for one thread (:class:`~aiosync.planes.cuda_vmm.MappingQuery`)."""
        return MappingQuery()

    def export(self, pointer: int) -> int:
        """A new descriptor of the allocation mapped at ``pointer`` (the caller closes it)."""
        return export_fd(pointer, self.device)

    def prepare(self) -> None:
        """Ready the serving thread to export the device's memory."""
        serve_device(self.device)


class FdRegions:
    """A trainer's memory without legacy handles on ``device``, as descriptor regions.

    :attr:`source` goes into the plane's hello (None, and :attr:`off` says why, where no
    socket could be made: such tensors are then packed). The mapping queries of
    :meth:`locate` and :meth:`still` are one thread's at a time (the sender's reader).
    """

    def __init__(self, device: int, allocations: CudaAllocations | None = None) -> None:
        self.device = device
        self.off = ""
        self._allocations = allocations or CudaAllocations(device)
        self._query = self._allocations.query()  # the reader's
        self._served = self._allocations.query()  # the server thread's
        self._regions: dict[Pieces, CudaFdRegion] = {}
        self._tried: set[int] = set()  # allocation ids exported once (they can be)
        self._by_ident: dict[int, Pieces] = {}  # what the server exports (under the lock)
        self._lock = threading.Lock()
        self._idents = itertools.count(1)
        self._server: FdServer | None = None
        try:
            self._server = FdServer(self._export, prepare=self._allocations.prepare)
        except OSError as exc:
            self.off = f"no descriptor socket: {exc}"

    @property
    def source(self) -> DescriptorSource | None:
        """Where engines fetch descriptors (None: descriptor passing is off)."""
        return None if self._server is None else self._server.source

    def locate(self, pointer: int, nbytes: int) -> tuple[CudaFdRegion, Pieces, int] | str:
        """The region of ``nbytes`` at ``pointer``, its pieces and the offset; or why not."""
        if self._server is None:
            return f"{NO_LEGACY}, and descriptor passing is off ({self.off})"
        pieces = span_pieces(pointer, nbytes, self._query)
        if isinstance(pieces, str):
            return pieces
        region = self._regions.get(pieces)
        if region is None:
            if pieces[0].block not in self._tried:
                why = self._exportable(pieces[0])
                if why:
                    return why
                self._tried.add(pieces[0].block)
            sizes = tuple(piece.size for piece in pieces)
            region = CudaFdRegion(next(self._idents), sizes, sum(sizes))
            with self._lock:
                self._by_ident[region.ident] = pieces
            self._regions[pieces] = region
            self._server.start()
        return region, pieces, pointer - pieces[0].base

    def still(self, pieces: Pieces) -> bool:
        """Whether each of ``pieces`` is still the allocation mapped at its base."""
        query = self._query
        return all(query(piece.base) == piece for piece in pieces)

    def retain(self, keys: Iterable[object]) -> None:
        """Forget every region but those of ``keys`` (a split made afresh names them)."""
        kept = set(keys)
        with self._lock:
            for pieces in [p for p in self._regions if p not in kept]:
                del self._by_ident[self._regions.pop(pieces).ident]
        self._tried &= {pieces[0].block for pieces in self._regions}

    def close(self) -> None:
        """Stop serving descriptors and forget every region (idempotent)."""
        if self._server is not None:
            self._server.close()
        with self._lock:
            self._regions.clear()
            self._by_ident.clear()
        self._tried.clear()

    def _export(self, ident: int, start: int, count: int) -> list[tuple[int, int]]:
        """The server's exporter: a new descriptor for each piece asked for, checked."""
        with self._lock:
            pieces = self._by_ident.get(ident)
        if pieces is None:
            raise AiosyncError(f"no region {ident} (its memory moved since)")
        chosen = pieces[start : start + count]
        if len(chosen) != count:
            raise AiosyncError(f"region {ident} has {len(pieces)} pieces")
        out: list[tuple[int, int]] = []
        try:
            for piece in chosen:
                out.append((self._export_piece(piece), piece.size))
        except BaseException:
            for fd, _ in out:
                os.close(fd)
            raise
        return out

    def _export_piece(self, piece: Mapping) -> int:
        """A descriptor of ``piece``, if it is (before and after) the allocation named."""
        moved = AiosyncError(f"the trainer's memory at {piece.base:#x} was remapped")
        if self._served(piece.base) != piece:
            raise moved
        fd = self._allocations.export(piece.base)
        if self._served(piece.base) != piece:
            os.close(fd)
            raise moved
        return fd

    def _exportable(self, piece: Mapping) -> str:
        """Why ``piece`` cannot be exported as a descriptor ("" when it can: tried once)."""
        try:
            os.close(self._allocations.export(piece.base))
        except AiosyncError as exc:
            return f"{NO_LEGACY}, and its file descriptor export failed: {exc.reason}"
        return ""


def check_fd_region(region: CudaFdRegion) -> None:
    """Raise :class:`ProtocolError` unless ``region``'s pieces are bounded and add up."""
    pieces = region.pieces
    if not 0 < len(pieces) <= MAX_PIECES:
        raise ProtocolError(f"a region of {len(pieces)} pieces (1-{MAX_PIECES})")
    if min(pieces) <= 0 or sum(pieces) != region.size:
        raise ProtocolError(f"a region of {region.size} bytes whose pieces do not add up to it")


def open_fd_region(
    region: CudaFdRegion, device: int, source: DescriptorSource | None
) -> ImportedMemory:
    """Map ``region`` on ``device`` from the descriptors of the trainer ``source`` names.

    Each batch of descriptors is imported as it arrives and closed right after. Raises
    :class:`ProtocolError` for a trainer that named no socket or descriptors that are not
    the region's pieces, :class:`AiosyncError` when the region cannot be opened.
    """
    if source is None:
        raise ProtocolError("a descriptor region from a trainer that named no socket")
    imports = Imports(device)

    def take(batch: list[tuple[int, int]]) -> None:
        at = len(imports.handles)
        if tuple(size for _, size in batch) != region.pieces[at : at + len(batch)]:
            raise ProtocolError("the trainer's descriptors are not the pieces its region named")
        imports.add([fd for fd, _ in batch])

    try:
        fetch_fds(source, region.ident, len(region.pieces), take)
        return imports.map(region.pieces)
    except ProtocolError:
        raise
    except AiosyncError as exc:
        raise AiosyncError(f"cannot open a trainer region: {exc.reason}") from None
    finally:
        imports.release()
