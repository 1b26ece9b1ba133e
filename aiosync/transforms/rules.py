"""Which tensors of a version are quantized, and what each becomes on the engine. Pure.

A :class:`TransformRules` picks a transform per tensor: by name (an ``fnmatch`` pattern or a
compiled regex, first match wins) or by a callable ``(name, tensor) -> transform | None``.
Tensors a model keeps in high precision pass unchanged whatever the rules say: 1-D tensors
and names matching ``embed``, ``norm``, ``bias`` or ``lm_head`` by default, and any dtype
other than bf16, fp16 and fp32. A quantized tensor becomes two, named as the engine's model
expects (:class:`OutputNames`; vLLM's by default: ``x.weight`` stays ``x.weight``, now e4m3,
beside ``x.weight_scale_inv`` for 128 x 128 blocks or ``x.weight_scale`` otherwise).
:meth:`TransformRules.plan` gives what a version carries from names, dtypes and shapes
alone (a meta tensor stands in for the data), so a layout can be planned before any read.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from aiosync.core.errors import MismatchError, UsageError
from aiosync.core.layout import dtype_from_name, dtype_name
from aiosync.core.manifest import TensorMeta, chunk_count
from aiosync.transforms.fp8_formats import (
    QUANTIZED_DTYPE,
    SOURCE_DTYPES,
    Fp8Format,
    check_quantizable,
    scale_dtype,
    scale_shape,
)

NamePattern = str | re.Pattern[str]
"""A ``str`` is an ``fnmatch`` pattern on the whole name; a compiled regex is searched."""

DEFAULT_KEEP: tuple[NamePattern, ...] = (re.compile(r"embed|norm|bias|lm_head"),)
"""Names kept in high precision by default: embeddings, norms, biases, the output head."""


@dataclass(frozen=True)
class OutputNames:
    """How a quantized tensor and its scales are named on the engine.

    Format strings over ``{name}`` (the tensor's name), ``{module}`` (up to its last dot)
    and ``{leaf}`` (after it).
    """

    weight: str = "{name}"
    scale: str = "{name}_scale"

    def __post_init__(self) -> None:
        for template in (self.weight, self.scale):
            try:
                template.format(name="a.b", module="a", leaf="b")
            except (KeyError, IndexError, ValueError) as exc:
                raise UsageError(f"output name {template!r} is not a template: {exc}") from None

    def of(self, name: str) -> tuple[str, str]:
        """The names of ``name``'s quantized values and of its scales."""
        module, _, leaf = name.rpartition(".")
        fields = {"name": name, "module": module, "leaf": leaf}
        return self.weight.format(**fields), self.scale.format(**fields)


def vllm_names(fmt: Fp8Format) -> OutputNames:
    """The names vLLM loads: ``{name}``, ``{name}_scale_inv`` (block) or ``{name}_scale``."""
    return OutputNames(scale="{name}_scale_inv" if fmt is Fp8Format.BLOCK else "{name}_scale")


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor a version carries after the transforms: what a layout needs, no data."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """The tensor's bytes."""
        return math.prod(self.shape) * dtype_from_name(self.dtype).itemsize

    def meta(self, capacity: int) -> TensorMeta:
        """Its manifest entry when sent through buffers of ``capacity`` bytes."""
        return TensorMeta(self.name, self.dtype, self.shape, chunk_count(self.nbytes, capacity))


@dataclass(frozen=True)
class Fp8Transform:
    """Quantize a tensor to e4m3 in ``format``; ``names`` default to :func:`vllm_names`."""

    format: Fp8Format
    names: OutputNames | None = None

    def output_names(self, name: str) -> tuple[str, str]:
        """The names of ``name``'s quantized values and scales on the engine."""
        return (self.names or vllm_names(self.format)).of(name)

    def plan(self, name: str, dtype: str, shape: tuple[int, ...]) -> tuple[PlannedTensor, ...]:
        """The quantized tensor and its scales; :class:`MismatchError` if it cannot be."""
        check_quantizable(self.format, dtype, shape, name)
        values, scales = self.output_names(name)
        return (
            PlannedTensor(values, QUANTIZED_DTYPE, shape),
            PlannedTensor(scales, scale_dtype(self.format), scale_shape(self.format, shape)),
        )


Chooser = Callable[[str, torch.Tensor], Fp8Transform | None]
"""A callable rule: the transform for a named tensor (a meta tensor when planning), or None."""


class TransformRules:
    """The transform of each tensor of a version: the kept tensors first, then the rules.

    ``rules`` is a sequence of ``(pattern, transform or None)``, the first whose pattern
    matches the name deciding (None: unchanged), or one :data:`Chooser`. A tensor matching
    no rule passes unchanged. ``keep`` names tensors kept in high precision before any rule
    (``()`` to keep none by name); ``keep_vectors`` keeps every 1-D tensor.
    """

    def __init__(
        self,
        rules: Sequence[tuple[NamePattern, Fp8Transform | None]] | Chooser,
        *,
        keep: Sequence[NamePattern] = DEFAULT_KEEP,
        keep_vectors: bool = True,
    ) -> None:
        self._rules = rules if callable(rules) else tuple(rules)
        self._keep = tuple(keep)
        self._keep_vectors = keep_vectors

    def transform_for(self, name: str, tensor: torch.Tensor) -> Fp8Transform | None:
        """The transform ``tensor`` gets, or None when it passes unchanged."""
        if dtype_name(tensor.dtype) not in SOURCE_DTYPES:
            return None
        if (self._keep_vectors and tensor.dim() == 1) or _matches_any(name, self._keep):
            return None
        if callable(self._rules):
            return self._rules(name, tensor)
        for pattern, transform in self._rules:
            if _matches(name, pattern):
                return transform
        return None

    def plan(self, name: str, dtype: str, shape: tuple[int, ...]) -> tuple[PlannedTensor, ...]:
        """What one tensor becomes, from its metadata alone: itself, or values and scales."""
        stand_in = torch.empty(shape, dtype=dtype_from_name(dtype), device="meta")
        transform = self.transform_for(name, stand_in)
        if transform is None:
            return (PlannedTensor(name, dtype, shape),)
        return transform.plan(name, dtype, shape)

    def plan_all(self, entries: Iterable[tuple[str, str, tuple[int, ...]]]) -> list[PlannedTensor]:
        """What a version of ``(name, dtype, shape)`` entries carries, in order.

        :class:`MismatchError` when an output name is taken twice (a scale's name that is
        also another tensor's, say).
        """
        planned: list[PlannedTensor] = []
        owners: dict[str, str] = {}
        for name, dtype, shape in entries:
            for out in self.plan(name, dtype, tuple(shape)):
                if out.name in owners:
                    raise MismatchError(
                        f"output name {out.name!r} of {name!r} is also {owners[out.name]!r}'s",
                        tensor=name,
                    )
                owners[out.name] = name
                planned.append(out)
        return planned


def _matches(name: str, pattern: NamePattern) -> bool:
    if isinstance(pattern, str):
        return fnmatch.fnmatchcase(name, pattern)
    return pattern.search(name) is not None


def _matches_any(name: str, patterns: Iterable[NamePattern]) -> bool:
    return any(_matches(name, pattern) for pattern in patterns)
