"""A trainer process for the handle tests: ``python -m tests.helpers.handle_trainer ENDPOINT``.

Connects to the engine served at ENDPOINT through the compat functions (Gloo), sends
version 1 (``mixed_weights(1)``) whole, then starts version 2 and dies (``os._exit``)
after broadcasting the first tensor of its first bucket: the engine is left inside its
receive of the second. Prints ``sent`` after version 1 and ``dying`` just before.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from aiosync.compat.distributed import (
    broadcast_hf_buckets_via_distributed_impl,
    connect_rollout_engines_from_distributed,
)
from aiosync.compat.nemo_rl import iter_named_tensor_buckets
from aiosync.handles import ChannelHandle, group_plane
from tests.helpers.models import mixed_weights


def emit(event: str) -> None:
    print(json.dumps({"event": event}), flush=True)


def main() -> None:
    handles = [ChannelHandle.connect(sys.argv[1], name="engine")]
    group = connect_rollout_engines_from_distributed(
        group_name="dies", rollout_engines=handles, engine_gpu_counts=[1]
    )

    def send(version: int) -> None:
        broadcast_hf_buckets_via_distributed_impl(
            bucket_iterator=iter_named_tensor_buckets(mixed_weights(version).items(), 1 << 17),
            rollout_engines=handles,
            rollout_engine_lock=None,
            group_name="dies",
            model_update_group=group,
            weight_version=version,
        )

    send(1)
    emit("sent")

    real = group_plane.send_bucket

    def die(group: Any, scratch: Any, tensors: list[Any], specs: list[Any], *rest: Any) -> None:
        real(group, scratch, tensors[:1], specs[:1], *rest)  # the first tensor only
        emit("dying")
        os._exit(0)

    group_plane.send_bucket = die  # the engine is left waiting for the second tensor
    send(2)


if __name__ == "__main__":
    main()
