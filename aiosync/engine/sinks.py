"""Where received tensors go: into an ``nn.Module`` by name, or to a ``load_weights`` callback.

A sink (:class:`WeightSink`, declared in :mod:`aiosync.engine.sink_base`) says once what it
takes (:meth:`WeightSink.expectations`), which the engine's session checks every version
and bucket against before any memory is touched. It is then driven from one worker thread:
:meth:`WeightSink.apply_bucket` with a bucket's bytes (a flat ``uint8`` view of the data
plane, valid only during the call) and the checked specs saying where each tensor lies in
them, then :meth:`WeightSink.commit` or :meth:`WeightSink.abort` at the end of the version.
(A sink that says ``applies_quickly()`` may have a bucket applied on the event loop
instead: :mod:`aiosync.engine.quick_apply`.)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from aiosync.core.layout import (
    SMALL_COPY,
    TensorSpec,
    address_copy,
    bytes_as_tensor,
    copy_bytes,
    dtype_from_name,
    dtype_name,
    is_plain,
    spec_bytes,
    tensor_bytes,
)
from aiosync.core.manifest import Expectations, expectations_of, module_tensors
from aiosync.core.where_to_run import on_loop
from aiosync.engine.bulk_apply import CopyPrograms, Part
from aiosync.engine.callback_sink import CallbackSink, LoadWeights
from aiosync.engine.sink_base import WeightSink, apply_parts
from aiosync.engine.sink_tools import Rename, rename_function, sync_cuda
from aiosync.engine.staging import SWAPS, Staging, Swap
from aiosync.planes.base import BucketContext


class ModuleSink(WeightSink):
    """Copies tensors into a module's parameters and buffers (or a name -> tensor map) by name.

    In-place (default) writes straight into the weights: fastest and no extra memory, but a
    broken stream leaves them mixed, and the receiver then marks the engine not servable;
    the choice for colocated engines that pause serving during a sync. ``staged=True``
    writes into a shadow copy (one per storage) made live only on commit, so a broken
    stream changes nothing. ``swap`` says how: ``"copy"`` (default) copies the shadow into
    the live tensor, which never moves (keep it for engines that captured CUDA graphs or
    hold raw pointers); ``"pointer"`` makes the shadow's storage the live tensor's (every
    name of a tied tensor, so they stay tied) and the old storage the next shadow: no copy
    at commit. Pointer swap needs readers to reach the weights through the module or the
    tensors given here (a tensor whose storage is also held elsewhere is copied instead),
    and no reference to ``param.data`` kept past a read lease. :meth:`reserve` allocates
    the shadows up front, refusing if they do not fit; :attr:`extra_bytes` is their size.

    A version must cover ``required`` (default: every parameter and persistent buffer of a
    module, every entry of a map; engine names); a tied parameter is covered by either of
    its names. When a version sends several names of one tensor (a tied model's
    ``state_dict()``), the first name sent is written and later ones are skipped (they
    still count as covered): each storage is written once per version.

    ``rename`` (a mapping or a function, sender's name -> engine's name; a mapping keeps
    names it does not list) is applied to every sent name before it is checked or written;
    the expectations stay keyed by engine names and apply the rename on each lookup, so
    errors name the tensor as sent and "missing" lists name the engine's tensors.

    ``cast=True`` lets a floating tensor arrive in another floating dtype (bf16 <-> fp32,
    fp32 -> fp16, ...) and converts it on arrival (``copy_``, so bf16 -> fp32 is exact);
    a tensor sent in chunks is assembled in its sent dtype first. Without it, a dtype
    mismatch is refused before any byte moves.
    """

    def __init__(
        self,
        module: torch.nn.Module | Mapping[str, torch.Tensor],
        *,
        staged: bool = False,
        required: Iterable[str] | None = None,
        rename: Rename | None = None,
        cast: bool = False,
        swap: Swap = "copy",
    ) -> None:
        if isinstance(module, torch.nn.Module):
            self.targets: dict[str, torch.Tensor] = {
                **dict(module.named_parameters(remove_duplicate=False)),
                **dict(module.named_buffers(remove_duplicate=False)),
            }
            default_required: Iterable[str] = module_tensors(module)
        else:
            self.targets = dict(module)
            default_required = self.targets
        self._required = frozenset(default_required if required is None else required)
        first = next(iter(self.targets.values()), None)
        self._device = first.device if first is not None else torch.device("cpu")
        self._devices = {t.device for t in self.targets.values()}
        self._on_cpu = all(device.type == "cpu" for device in self._devices)
        self._staged = staged
        if swap not in SWAPS:
            raise ValueError(f"swap must be one of {SWAPS}, got {swap!r}")
        if swap != "copy" and not staged:
            raise ValueError(f"swap={swap!r} makes a staged version live: it needs staged=True")
        self._staging = Staging(self.targets, swap) if staged else None
        # name -> (address, flat bytes if plain, whether plain on the CPU)
        self._bytes: dict[str, tuple[int, torch.Tensor | None, bool]] = {}
        self._views = False  # whether any entry of _bytes holds a view
        self._rename = rename_function(rename)
        self._cast = cast
        self._dtypes = {n: dtype_name(t.dtype) for n, t in self.targets.items()} if cast else {}
        self._aliases: dict[str, str] = {}  # from expectations(): engine alias -> owner
        self._tied: set[str] = set()  # every name of a tied tensor
        self._programs = CopyPrograms()  # in place: repeated buckets in one call each
        self._writer: dict[str, str] = {}  # owner -> the sent name writing it this version
        self._assembling: dict[str, torch.Tensor] = {}  # chunks of a tensor to cast
        self._context: BucketContext | None = None  # the bucket's, during apply_with

    @property
    def device(self) -> torch.device:
        """The device of the module's first tensor."""
        return self._device

    @property
    def staged(self) -> bool:
        """Whether writes wait for commit."""
        return self._staged

    def expectations(self) -> Expectations:
        """Every target by name with its dtype and shape; tied names are aliases.

        Floating targets are castable with ``cast=True``; ``rename`` applies to each lookup.
        """
        found = expectations_of(self.targets, self._required, cast=self._cast, rename=self._rename)
        self._aliases = found.aliases
        self._tied = set(found.aliases) | set(found.aliases.values())
        return found

    @property
    def extra_bytes(self) -> int:
        """Bytes held for staging (the shadows allocated so far; 0 in place)."""
        return 0 if self._staging is None else self._staging.extra_bytes

    def reserve(self) -> None:
        """Staged: allocate every shadow now (in place: nothing to do).

        Raises :class:`~aiosync.AiosyncError` saying how many bytes staging needs and how
        many are free (device memory for CUDA, available host memory for the CPU) when they
        do not fit.
        """
        if self._staging is not None:
            self._staging.reserve()

    def _second_name(self, sent: str, name: str) -> bool:
        """Whether ``name`` (engine name of ``sent``) is a tensor another name wrote already."""
        owner = self._aliases.get(name, name)
        return self._writer.setdefault(owner, sent) != sent

    def _cast_in(self, dst: torch.Tensor, raw: torch.Tensor, spec: TensorSpec) -> None:
        """Convert a spec of another dtype into ``dst``; chunks are assembled first."""
        if spec.is_whole:
            dst.copy_(bytes_as_tensor(raw, spec), non_blocking=True)
            return
        whole = self._assembling.get(spec.name)
        if whole is None:
            whole = torch.empty(spec.shape, dtype=dtype_from_name(spec.dtype), device=raw.device)
            self._assembling[spec.name] = whole
        copy_bytes(tensor_bytes(whole)[spec.start : spec.start + spec.nbytes], raw)
        if spec.is_last_chunk:
            dst.copy_(self._assembling.pop(spec.name), non_blocking=True)

    def _destination(self, name: str) -> tuple[torch.Tensor, int, torch.Tensor | None, bool]:
        """Where ``name`` is written: tensor, address, flat bytes, whether copied by address.

        Flat bytes exist for plain targets; small plain CPU ones are copied by address. Views
        are made once per tensor and address, not once per bucket: for small tensors the
        per-tensor view calls cost more than the copies.
        """
        if self._staging is not None:  # keyed by the tensor's first name: one per storage
            key, dst = self._staging.write(name)
        else:
            key, dst = name, self.targets[name]
        address = dst.data_ptr()
        cached = self._bytes.get(key)
        if cached is None or cached[0] != address:
            plain = is_plain(dst)
            by_address = plain and dst.is_cpu  # then no view is kept: fewer objects to scan
            view = tensor_bytes(dst.detach()) if plain and not by_address else None
            cached = (address, view, by_address)
            self._bytes[key] = cached
            self._views = self._views or view is not None
        return dst, address, cached[1], cached[2]

    def _as_is(self, spec: TensorSpec) -> torch.Tensor | None:
        """The target a copy program writes ``spec`` into (in place, untied, not cast)."""
        name = spec.name
        if name in self._tied or (self._cast and spec.dtype != self._dtypes.get(name)):
            return None
        return self.targets.get(name)

    def apply_bucket(self, bucket: torch.Tensor, specs: list[TensorSpec]) -> None:
        """Copy each spec's bytes into its destination, then wait for the device to finish.

        In place and without a rename, the tensors of a bucket the session resolved before
        (the same spec list) are copied by address without per-tensor lookups
        (:mod:`aiosync.engine.bulk_apply`).
        """
        self.apply_parts([(bucket, specs)])

    def apply_parts(self, parts: list[Part]) -> None:
        """:meth:`apply_bucket` for a bucket in several parts (a direct bucket's regions).

        One call a bucket: in place and without a rename, one copy program a part, set up
        (device, stream) once for all; everything else spec by spec; one device wait at the
        end (none while a CUDA plane orders the copies: the bucket's context says so).
        """
        context = self._context
        if self._staging is None and self._rename is None:
            parts = self._programs.apply_parts(parts, self._as_is, context)
        for bucket, specs in parts:
            if specs:
                self._copy_specs(bucket, specs)
        sync_cuda(self._devices, context)

    def apply_with(self, parts: list[Part], context: BucketContext) -> None:
        """One bucket from the receiver: its parts, under its context (hints, deferred wait).

        The context holds for this call, also through a subclass's override of
        :meth:`apply_bucket` or :meth:`apply_parts` that calls this class's.
        """
        self._context = context
        try:
            super().apply_with(parts, context)
        finally:
            self._context = None

    def applies_quickly(self) -> bool:
        """Whether a bucket's apply may run on the receiver's event loop (if quick last time).

        True for this class's own in-place copies by address without a rename
        (:mod:`aiosync.engine.quick_apply` then decides bucket by bucket, by their measured
        time); False for a staged or renaming sink and for a subclass that overrides how
        buckets are applied (its code may block, or need a worker thread).
        """
        own = type(self).apply_parts is ModuleSink.apply_parts
        own = own and type(self).apply_bucket is ModuleSink.apply_bucket
        return own and self._staging is None and self._rename is None

    def _copy_specs(self, bucket: torch.Tensor, specs: list[TensorSpec]) -> None:
        """Copy ``specs`` out of ``bucket`` one by one (renamed, tied, cast, staged, ...)."""
        base = bucket.data_ptr() if bucket.is_cpu else None
        rename, cast = self._rename, self._cast
        once = bool(self._aliases) or rename is not None  # one target may have two names
        with torch.no_grad():
            for spec in specs:
                name = spec.name if rename is None else rename(spec.name)
                if once and self._second_name(spec.name, name):
                    continue
                dst, address, dst_bytes, by_address = self._destination(name)
                if cast and spec.dtype != self._dtypes[name]:
                    self._cast_in(dst, spec_bytes(bucket, spec), spec)
                    continue
                if base is not None and by_address and spec.nbytes <= SMALL_COPY:
                    address_copy(address + spec.start, base + spec.offset, spec.nbytes)
                    continue
                raw = spec_bytes(bucket, spec)
                if dst_bytes is None and by_address:  # large, or fed from another device
                    dst_bytes = tensor_bytes(dst.detach())
                if dst_bytes is None:  # a non-contiguous target: whole tensors only (checked)
                    dst.copy_(bytes_as_tensor(raw, spec), non_blocking=True)
                elif spec.is_whole:
                    copy_bytes(dst_bytes, raw)
                else:
                    copy_bytes(dst_bytes[spec.start : spec.start + spec.nbytes], raw)

    def commit(self, version: int) -> None:
        """Staged mode: make every shadow written since the last commit live (``swap``)."""
        with torch.no_grad():
            moved = self._staging.commit() if self._staging is not None else []
        self._committed(moved or ())
        sync_cuda(self._devices)

    def commit_quickly(self, version: int) -> bool:
        """Commit now if no byte has to move (in place, or every tensor swaps by pointer).

        Returns False, having done nothing, otherwise (call :meth:`commit`), always for a
        subclass that overrides :meth:`commit`, for weights on a GPU (their commit waits for
        the device's copies, which a CUDA plane ordered by events leaves queued), and for
        more than :data:`~aiosync.core.where_to_run.LOOP_ENTRIES` tensors (a few µs each:
        longer would stall the loop). The receiver calls it on its event loop to spare a
        swap the thread hop.
        """
        if type(self).commit is not ModuleSink.commit or not self._on_cpu:
            return False
        if self._staging is None:
            self._committed(())
            return True
        if not on_loop(entries=len(self._staging.pending)):  # per-tensor work: off the loop
            return False
        with torch.no_grad():
            moved = self._staging.commit(pointers_only=True)
        if moved is None:
            return False
        self._committed(moved)
        return True

    def _committed(self, moved: Iterable[str]) -> None:
        self._programs.version_done()
        if self._views:  # a moved key's shadow is another storage now: drop its cached view
            for key in moved:
                self._bytes.pop(key, None)
        self._writer.clear()

    def abort(self) -> None:
        """Staged mode: forget written shadows (the model was never touched)."""
        if self._staging is not None:
            self._staging.abort()
        self._writer.clear()
        self._assembling.clear()


__all__ = ["CallbackSink", "LoadWeights", "ModuleSink", "Rename", "WeightSink", "apply_parts"]
