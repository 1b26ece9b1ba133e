"""A debugging aid: catch a trainer that changes its tensors before they are all packed."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import torch

from aiosync.core.errors import MismatchError


def snapshot_check(pairs: Collection[tuple[str, Any]], samples: int = 16) -> Callable[[], None]:
    """A check that up to ``samples`` of ``pairs``' tensors still hold what they held now.

    Sampled evenly, a few leading bytes of each; the check raises :class:`MismatchError`
    naming the first tensor that changed (the trainer stepped before the version was packed).
    """
    items = list(pairs)
    step = max(1, len(items) // samples)
    taken = []
    for name, tensor in items[::step][:samples]:
        if isinstance(tensor, torch.Tensor) and tensor.numel():
            taken.append((name, tensor, tensor.detach().reshape(-1)[:64].clone()))

    def check() -> None:
        for name, tensor, before in taken:
            if not torch.equal(tensor.detach().reshape(-1)[:64], before):
                raise MismatchError(
                    "the tensor changed while the version was being packed (an optimizer step "
                    "before send's packed event?)",
                    tensor=name,
                )

    return check
