"""Transforms a tensor takes on its way to an engine: FP8 quantization (docs/fp8.md).

:mod:`~aiosync.transforms.rules` declares which tensors are quantized and what they become
(pure); :mod:`~aiosync.transforms.fp8` quantizes into a packing buffer's views, bit for bit
what :mod:`~aiosync.transforms.fp8_reference` computes.
"""

from aiosync.transforms.fp8 import quantize, quantize_into
from aiosync.transforms.fp8_formats import Fp8Format
from aiosync.transforms.rules import (
    DEFAULT_KEEP,
    Fp8Transform,
    OutputNames,
    PlannedTensor,
    TransformRules,
    vllm_names,
)

__all__ = [
    "DEFAULT_KEEP",
    "Fp8Format",
    "Fp8Transform",
    "OutputNames",
    "PlannedTensor",
    "TransformRules",
    "quantize",
    "quantize_into",
    "vllm_names",
]
