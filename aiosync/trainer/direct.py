"""How a sender in direct mode splits a version: tensors read in place, and the rest packed.

A tensor goes direct when it is persistent and its memory is a region engines can open
(:mod:`aiosync.planes.direct_regions`). Persistent: with ``direct=True``, every
``nn.Parameter`` and every tensor in a segment of :func:`aiosync.share_tensors`; with a
collection of names, exactly those names. Everything else (casts, gathered tensors,
tensors in memory engines cannot open) is packed in the same version, and
:attr:`DirectReader.note` says how much was packed that was asked to go direct, and why.

Direct buckets come first (engines copy them while the trainer packs the rest); how they
are cut is :mod:`aiosync.trainer.direct_plans`.

The split is kept across versions while the chosen tensors are the same objects at the same
addresses, dtypes, shapes and strides and every region still holds them. That last check is a lookup
per region (a driver query on CUDA), skipped for regions that were whole segments of torch's
caching allocator while its segment counters show no release since the last check: the
argument is in :mod:`aiosync.planes.direct_regions`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, ItemsView, Mapping, Sequence
from itertools import chain
from typing import Any

import torch

from aiosync.core.layout import DTYPE_NAMES, calculate_aligned_size
from aiosync.core.manifest import TensorMeta, module_tensors, unique_storage, visible_pairs
from aiosync.core.planning import Planner, VersionSource, read_source
from aiosync.core.where_to_run import on_loop
from aiosync.core.wire import Region
from aiosync.planes.direct import DIRECT_BYTES, DirectPlan, DirectSenderPlane
from aiosync.planes.direct_regions import RegionFinder, Spot
from aiosync.planes.shared_tensors import find_shared
from aiosync.trainer.direct_plans import direct_plans, distinct, within_bounds


class DirectReader:
    """Reads versions for a sender's :class:`DirectSenderPlane` (a worker thread's work).

    ``chosen``: True for parameters and shared-segment tensors, or the names to read in
    place. :attr:`note` and :attr:`direct_bytes` describe the last version read.
    """

    def __init__(self, plane: DirectSenderPlane, chosen: bool | frozenset[str]) -> None:
        self.plane = plane
        self.chosen = chosen
        self.note = ""
        self.direct_bytes = 0
        self.fresh = False
        """Whether the last read split its tensors afresh (else it kept the last split)."""
        self.checked = 0
        """Lookups the last read made: a region each for a kept split's check (0 when the
        allocator vouched for every region), or a tensor each for a fresh split."""
        self._kept: _Kept | None = None  # the last version's split, reused while it holds
        self._pairs = 0  # tensors the last version read had

    @property
    def regions(self) -> list[Region]:
        """The regions the last split reads directly, each once, in the order met."""
        return [] if self._kept is None else [spot.region for _, spot in self._kept.probes]

    def _persistent(self, name: str, tensor: torch.Tensor) -> bool:
        if self.chosen is True:
            return isinstance(tensor, torch.nn.Parameter) or find_shared(tensor) is not None
        return self.chosen is not False and name in self.chosen

    def read(
        self,
        source: Any,
        given: Sequence[TensorMeta] | Mapping[str, torch.Tensor] | None,
        capacity: int,
        max_items: int,
        planner: Planner | None = None,
    ) -> VersionSource:
        """As :func:`~aiosync.core.planning.read_source`, with persistent tensors direct."""
        self.note, self.direct_bytes = "", 0
        if isinstance(source, torch.nn.Module):
            source = module_tensors(source)
        pairs = visible_pairs(source)
        if given is not None or pairs is None:
            self.note = "direct mode needs a module, a mapping or a list (no manifest=): packed"
            return read_source(source, given, capacity, max_items, planner)
        pairs, chosen, packed = self._sort(source, pairs)
        finder = self.plane.finder
        mark = finder.marker()  # before every lookup it is to vouch for
        kept = self._kept
        if kept is not None and kept.matches(chosen, finder, mark):
            self.fresh, self.checked = False, kept.checked
        else:
            kept = self._kept = self._split(chosen, mark)
            self.fresh, self.checked = True, len(chosen)
        return self._source(kept, pairs, packed, capacity, max_items, planner)

    def read_kept(
        self, source: Any, capacity: int, max_items: int, planner: Planner | None = None
    ) -> VersionSource | None:
        """:meth:`read`, if the last split still holds and ``source`` is small; else None.

        Bounded work (as many tensors and regions looked up as
        :func:`~aiosync.core.where_to_run.on_loop` allows, no export), so a sender may call
        it on its event loop and skip the hop to a worker thread; None asks for :meth:`read`
        in a thread. Only a split with direct tensors: the version's bucket 1 is then a
        direct bucket, nothing to pack (whose planning could wait on values or copy a
        tensor).
        """
        kept = self._kept
        if kept is None or not kept.direct or not on_loop(entries=self._pairs):
            return None  # nothing direct (bucket 1 is to pack), or a large version
        if isinstance(source, torch.nn.Module):
            source = module_tensors(source)
        pairs = visible_pairs(source)
        if pairs is None or not on_loop(entries=len(pairs)):
            return None
        pairs, chosen, packed = self._sort(source, pairs)
        finder = self.plane.finder
        if not kept.matches(chosen, finder, finder.marker(), on_the_loop=True):
            return None
        self.note, self.direct_bytes = "", 0
        self.fresh, self.checked = False, kept.checked
        return self._source(kept, pairs, packed, capacity, max_items, planner)

    def kept_first(self) -> DirectPlan | None:
        """Bucket 1's plan if the next read keeps the last split: a guess, before reading.

        Only once the last read kept the split it found (a trainer whose tensors move every
        version never has one), and only a direct plan: the plan object a kept read hands
        out again, which :func:`~aiosync.pipeline.fanout.kept_first_payload` encodes.
        """
        kept = self._kept
        if self.fresh or kept is None or not kept.direct or kept.plans is None:
            return None
        plans = kept.plans[0]
        return plans[0] if plans else None

    def _sort(
        self, source: Any, pairs: Collection[tuple[str, Any]]
    ) -> tuple[Collection[tuple[str, Any]], list[tuple[str, torch.Tensor]], list[tuple[str, Any]]]:
        """``pairs`` (tied tensors once), and those of them chosen to go direct, and the rest."""
        if isinstance(source, Mapping | ItemsView):
            pairs = unique_storage(pairs)
        chosen: list[tuple[str, torch.Tensor]] = []
        packed: list[tuple[str, Any]] = []
        for name, tensor in pairs:
            if isinstance(tensor, torch.Tensor) and self._persistent(name, tensor):
                chosen.append((name, tensor))
            else:
                packed.append((name, tensor))
        return pairs, chosen, packed

    def _source(
        self,
        kept: _Kept,
        pairs: Collection[tuple[str, Any]],
        packed: list[tuple[str, Any]],
        capacity: int,
        max_items: int,
        planner: Planner | None,
    ) -> VersionSource:
        """The version as ``kept`` splits it: its direct buckets, then the packed tensors.

        Those are ``packed`` (not chosen) and the chosen ones the split packs.
        """
        self.note = "; ".join(n for n in (self._unchosen_note(packed), kept.note) if n)
        packed.extend(kept.chosen[i] for i in kept.packed)
        self._pairs = len(pairs)
        rest = read_source(packed, None, capacity, max_items, planner)
        if not kept.direct:
            return rest
        first = len(rest.manifest) if rest.manifest is not None else None
        if kept.plans is None or (kept.first, kept.max_items) != (first, max_items):
            kept.first, kept.max_items = first, max_items  # the engines' bound may change
            kept.plans = direct_plans(kept.direct, first, max_items, self.plane.count)
            kept.manifests = None
        plans, metas, moved = kept.plans
        self.direct_bytes = moved
        manifest = None if rest.manifest is None else kept.manifest(rest.manifest, metas)
        every = [*pairs] if rest.pairs is not None else None
        return VersionSource(every, manifest, chain(plans, rest.plans))

    def _unchosen_note(self, unchosen: list[tuple[str, Any]]) -> str:
        """Why tensors handed to a direct sender were packed without being asked about."""
        tensors = [t for _, t in unchosen if isinstance(t, torch.Tensor)]
        if not tensors:
            return ""
        size = sum(t.nbytes for t in tensors)
        if self.chosen is True:
            why = (
                "not persistent: only nn.Parameter objects (pass the module or its "
                "named_parameters(), not state_dict(), which detaches them) and tensors of "
                "share_tensors() go direct"
            )
        else:
            why = "not among the names direct= lists"
        return f"{len(tensors)} tensors ({size} bytes) packed: {why}"

    def _split(self, chosen: list[tuple[str, torch.Tensor]], mark: object) -> _Kept:
        """Locate every chosen tensor: which go direct, which are packed, and why.

        ``mark`` is the finder's marker read before; None: no region is vouched for.
        """
        direct: list[tuple[str, torch.Tensor, Spot]] = []
        refused: Counter[str] = Counter()
        refused_bytes = 0
        at: dict[int, int] = {}
        packed: list[int] = []
        for i, (name, tensor) in enumerate(chosen):
            spot = self._locate(tensor)
            if isinstance(spot, str):
                refused[spot] += 1
                refused_bytes += tensor.nbytes
                packed.append(i)
            else:
                at[id(tensor)] = i
                direct.append((name, tensor, spot))
        overlapping: list[tuple[str, Any]] = []
        direct = distinct(direct, overlapping)
        beyond: list[tuple[str, Any]] = []
        direct = within_bounds(direct, beyond)
        if beyond:
            refused["past the engines' bound on open regions"] += len(beyond)
            refused_bytes += sum(tensor.nbytes for _, tensor in beyond)
        packed.extend(at[id(tensor)] for _, tensor in [*overlapping, *beyond])
        note = ""
        if refused:
            why = "; ".join(f"{reason} ({n})" for reason, n in refused.most_common())
            note = f"{sum(refused.values())} tensors ({refused_bytes} bytes) packed: {why}"
        finder = self.plane.finder
        keys = {s.key for _, _, s in direct}
        finder.retain(keys)  # descriptor regions of an older split are served no more
        owned = finder.allocator_owned(keys) if mark is not None else set()
        return _Kept(chosen, direct, packed, note, mark, owned)

    def _locate(self, tensor: torch.Tensor) -> Spot | str:
        if DTYPE_NAMES.get(tensor.dtype) is None:
            return "of a dtype that cannot be streamed"
        if tensor.nbytes == 0:
            return "empty"
        spot = self.plane.finder.locate(tensor)
        if not isinstance(spot, str) and calculate_aligned_size(spot.region.size) > DIRECT_BYTES:
            return "in a region larger than a direct bucket"
        return spot


class _Kept:
    """One version's split of its chosen tensors, reused while nothing it rests on changed.

    That is: the same tensor objects at the same addresses, dtypes, shapes and strides, and each
    region still the same allocation (or open segment). It holds the tensors (so an id
    seen again is the same object) until the next change. Regions in ``owned`` (whole
    segments of torch's caching allocator) are not looked up while the finder's marker
    equals ``mark``, the one read before the last lookups.
    """

    def __init__(
        self,
        chosen: list[tuple[str, torch.Tensor]],
        direct: list[tuple[str, torch.Tensor, Spot]],
        packed: list[int],
        note: str,
        mark: object = None,
        owned: set[object] | None = None,
    ) -> None:
        self.chosen = chosen
        self.names = [name for name, _ in chosen]
        self.ids = [id(t) for _, t in chosen]
        self.addresses = [t.data_ptr() for _, t in chosen]
        self.dtypes = [t.dtype for _, t in chosen]
        self.shapes = [t.shape for _, t in chosen]
        self.strides = [t.stride() for _, t in chosen]  # a view made in place (``.t()``)
        self.direct = direct
        self.packed = packed
        self.note = note
        self.first: int | None = None
        self.max_items = 0  # the bound ``plans`` were made for
        self.plans: tuple[list[DirectPlan], list[TensorMeta], int] | None = None
        # the last whole manifest and the packed part it was made of (one list while
        # neither changes: the begin's encoded bytes are then kept, see pipeline.begin)
        self.manifests: tuple[list[TensorMeta], list[TensorMeta]] | None = None
        probes: dict[object, tuple[torch.Tensor, Spot]] = {}
        for _, tensor, spot in direct:
            probes.setdefault(spot.key, (tensor, spot))
        self.probes = list(probes.values())  # one tensor per region
        owned = owned or set()
        self.watched = [probe for probe in self.probes if probe[1].key not in owned]
        self.mark = mark
        self.checked = 0  # lookups the last match made

    def manifest(self, packed: list[TensorMeta], metas: list[TensorMeta]) -> list[TensorMeta]:
        """``packed`` then ``metas``: the same list as last time if ``packed`` is unchanged."""
        last = self.manifests
        if last is None or last[1] != packed:
            last = self.manifests = ([*packed, *metas], packed)
        return last[0]

    def matches(
        self,
        chosen: list[tuple[str, torch.Tensor]],
        finder: RegionFinder,
        mark: object,
        on_the_loop: bool = False,
    ) -> bool:
        """Whether ``chosen`` is what was split (one comprehension per property).

        ``mark``: the finder's marker, read before this call. Equal to the one read before
        the last lookups, it vouches for the owned regions: only the others are looked up,
        and ``on_the_loop``, if more would be than :func:`~aiosync.core.where_to_run.on_loop`
        allows, the answer is False.
        """
        tensors = [t for _, t in chosen]
        self.checked = 0
        same = (
            len(chosen) == len(self.ids)
            and [id(t) for t in tensors] == self.ids
            and [name for name, _ in chosen] == self.names
            and [t.data_ptr() for t in tensors] == self.addresses
            and [t.dtype for t in tensors] == self.dtypes
            and all(t.shape == shape for t, shape in zip(tensors, self.shapes, strict=True))
            and [t.stride() for t in tensors] == self.strides
        )
        if not same:
            return False
        probes = self.watched if mark is not None and mark == self.mark else self.probes
        if on_the_loop and not on_loop(lookups=len(probes)):
            return False
        self.checked = len(probes)
        if not all(finder.still(tensor, spot) for tensor, spot in probes):
            return False
        self.mark = mark
        return True
