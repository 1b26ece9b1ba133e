"""A sink that hands tensors to a ``load_weights`` callback: :class:`CallbackSink`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from aiosync.core.errors import MismatchError
from aiosync.core.layout import (
    TensorSpec,
    bytes_as_tensor,
    copy_bytes,
    dtype_from_name,
    dtype_name,
    spec_bytes,
    tensor_bytes,
)
from aiosync.core.manifest import Expectations, Expected, TensorMeta
from aiosync.engine.sink_base import WeightSink
from aiosync.engine.sink_tools import Rename, rename_function, sync_cuda
from aiosync.planes.base import BucketContext, Part

LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], object]


class RenamedExpectations(Expectations):
    """Expectations under a rename that also refuse two sent names renamed to one tensor.

    An unknown name is refused naming the tensor as sent and what it was renamed to.
    """

    def check(self, meta: TensorMeta | Any) -> None:
        """Raise :class:`MismatchError` unless one tensor fits (see :class:`Expectations`)."""
        assert self.rename is not None
        if self.rename(meta.name) not in self.tensors:
            raise self.unknown(meta.name, "tensor in the engine")
        super().check(meta)

    def check_manifest(self, manifest: Iterable[TensorMeta]) -> None:
        """Refuse a version sending two names that rename to one tensor, then check it."""
        entries = list(manifest)
        one_name_each(entries, self.rename)
        super().check_manifest(entries)


def one_name_each(manifest: Iterable[TensorMeta], rename: Callable[[str], str] | None) -> None:
    """Raise :class:`MismatchError` if two sent names become one engine name."""
    if rename is None:
        return
    first: dict[str, str] = {}
    for meta in manifest:
        target = rename(meta.name)
        sent = first.setdefault(target, meta.name)
        if sent != meta.name:
            raise MismatchError(
                f"both {sent!r} and {meta.name!r} are renamed to {target!r}", tensor=meta.name
            )


class CallbackSink(WeightSink):
    """Hands each bucket's tensors to ``load_weights(pairs)``, the shape of vLLM's loader.

    The tensors are views into shared memory (on the CPU mapped read-only: a write through
    one is a SIGSEGV), valid only during the call: the callback must copy what it keeps or
    changes. A tensor split across buckets is assembled first and passed whole.
    ``expected`` (name -> (dtype, shape)) enables checks before anything is passed on, and
    then a version must cover ``required`` (default: every expected name). With
    ``expected``, ``cast=True`` accepts a floating tensor in another floating dtype and
    hands it on converted to the expected dtype (a new tensor, assembled first if chunked).

    ``rename`` (a mapping or a function, sender's name -> callback's name; a mapping keeps
    names it does not list) is applied to every sent name: the callback gets renamed names,
    and ``expected``/``required`` are in renamed names. Checks use the renamed names; errors
    name the tensor as sent. Two sent names that rename to one name are refused, before any
    byte moves when the sender sent a manifest, else when the second one arrives (the stream
    is then refused, and the callback may have had the first).
    """

    def __init__(
        self,
        load_weights: LoadWeights,
        *,
        device: torch.device | str = "cpu",
        expected: Mapping[str, tuple[torch.dtype, tuple[int, ...]]] | None = None,
        required: Iterable[str] | None = None,
        on_commit: Callable[[int], object] | None = None,
        cast: bool = False,
        rename: Rename | None = None,
    ) -> None:
        if cast and expected is None:
            raise ValueError("cast=True needs expected= (the dtypes to cast to)")
        self._cast = cast
        self._load = load_weights
        self._device = torch.device(device)
        self._expected = expected
        self._required = required
        self._on_commit = on_commit
        self._rename = rename_function(rename)
        self._assembling: dict[str, torch.Tensor] = {}
        self._sent_as: dict[str, str] = {}  # renamed -> sent name, this version
        self._context: BucketContext | None = None  # the bucket's, during apply_with

    @property
    def device(self) -> torch.device:
        """Where the callback wants its tensors."""
        return self._device

    @property
    def staged(self) -> bool:
        """False: the callback applies tensors as they arrive."""
        return False

    def expectations(self) -> Expectations | None:
        """With ``expected``: those names, dtypes and shapes; otherwise None (anything).

        With ``rename``, sent names are renamed before each check and a manifest sending two
        names of one tensor is refused.
        """
        if self._expected is None:
            return None
        tensors = {
            name: Expected(
                dtype_name(dtype), tuple(shape), castable=self._cast and dtype.is_floating_point
            )
            for name, (dtype, shape) in self._expected.items()
        }
        required = frozenset(self._expected if self._required is None else self._required)
        if self._rename is None:
            return Expectations(tensors, required)
        return RenamedExpectations(tensors, required, rename=self._rename)

    def _name(self, sent: str) -> str:
        """The callback's name for ``sent``; a second sent name for one tensor is refused."""
        if self._rename is None:
            return sent
        name = self._rename(sent)
        first = self._sent_as.setdefault(name, sent)
        if first != sent:
            raise MismatchError(f"both {first!r} and {sent!r} are renamed to {name!r}", tensor=sent)
        return name

    def apply_bucket(self, bucket: torch.Tensor, specs: list[TensorSpec]) -> None:
        """Pass whole tensors on in one call; keep chunks until their tensor is whole."""
        ready: list[tuple[str, torch.Tensor]] = []
        for spec in specs:
            raw = spec_bytes(bucket, spec)
            if spec.is_whole:
                ready.append((self._name(spec.name), bytes_as_tensor(raw, spec)))
                continue
            whole = self._assembling.get(spec.name)
            if whole is None:
                whole = torch.empty(
                    spec.shape, dtype=dtype_from_name(spec.dtype), device=raw.device
                )
                self._assembling[spec.name] = whole
            copy_bytes(tensor_bytes(whole)[spec.start : spec.start + spec.nbytes], raw)
            if spec.is_last_chunk:
                ready.append((self._name(spec.name), self._assembling.pop(spec.name)))
        if ready and self._cast:
            ready = [(name, self._converted(name, tensor)) for name, tensor in ready]
        if ready:
            self._load(ready)
        sync_cuda([self._device], self._context)

    def apply_with(self, parts: list[Part], context: BucketContext) -> None:
        """One bucket from the receiver, one :meth:`apply_bucket` a part, under its context."""
        self._context = context
        try:
            super().apply_with(parts, context)
        finally:
            self._context = None

    def _converted(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` in the dtype expected under ``name`` (itself when it already is)."""
        assert self._expected is not None  # cast needs expected (checked in __init__)
        want = self._expected.get(name)
        if want is None or want[0] == tensor.dtype:
            return tensor
        return tensor.to(want[0])

    def commit(self, version: int) -> None:
        """Call ``on_commit(version)`` if given."""
        self._sent_as.clear()
        if self._on_commit is not None:
            self._on_commit(version)

    def abort(self) -> None:
        """Drop half-assembled tensors."""
        self._assembling.clear()
        self._sent_as.clear()
