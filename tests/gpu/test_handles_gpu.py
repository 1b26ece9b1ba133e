"""The compat broadcast path over NCCL: trainer on GPU 0, an engine process on GPU 1."""

from __future__ import annotations

import pytest
import torch

from aiosync.compat import distributed
from aiosync.compat.distributed import (
    broadcast_hf_buckets_via_distributed_impl,
    connect_rollout_engines_from_distributed,
    disconnect_rollout_engines_from_distributed,
)
from aiosync.compat.nemo_rl import iter_named_tensor_buckets
from aiosync.handles import ChannelHandle
from tests.conftest import requires_two_gpus
from tests.helpers.handle_peers import EngineProcess, engine_process
from tests.helpers.models import digest, mixed_weights


def _sync(engine: EngineProcess, handles: list[ChannelHandle], group: object, version: int) -> None:
    weights = {n: t.to("cuda:0") for n, t in mixed_weights(version).items()}
    broadcast_hf_buckets_via_distributed_impl(
        bucket_iterator=iter_named_tensor_buckets(weights.items(), 1 << 17),
        rollout_engines=handles,
        rollout_engine_lock=None,
        group_name="nccl",
        model_update_group=group,  # type: ignore[arg-type]
        weight_version=version,
    )
    event = engine.wait_for("committed", version=version)
    assert event["digests"] == {n: digest(t) for n, t in weights.items()}


@pytest.mark.multigpu
@requires_two_gpus
@pytest.mark.timeout(150)
def test_nccl_trainer_gpu0_engine_gpu1_bit_exact_both_formats_and_reconnect(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(distributed.BACKEND_ENV, "nccl")
    monkeypatch.setenv(distributed.TIMEOUT_ENV, "60")
    with engine_process("--device", "cuda:1", "--timeout", "60") as engine:
        handles = [ChannelHandle.connect(engine.endpoint, name="gpu1")]
        try:
            group = connect_rollout_engines_from_distributed(
                group_name="nccl", rollout_engines=handles, engine_gpu_counts=[1]
            )
            monkeypatch.setenv(distributed.FORMAT_ENV, "per_tensor")
            _sync(engine, handles, group, 1)
            monkeypatch.setenv(distributed.FORMAT_ENV, "flattened")
            _sync(engine, handles, group, 2)
            disconnect_rollout_engines_from_distributed(
                group_name="nccl", model_update_group=group, rollout_engines=handles
            )
            group = connect_rollout_engines_from_distributed(
                group_name="nccl", rollout_engines=handles, engine_gpu_counts=[1]
            )
            _sync(engine, handles, group, 3)
            disconnect_rollout_engines_from_distributed(
                group_name="nccl", model_update_group=group, rollout_engines=handles
            )
        finally:
            for handle in handles:
                distributed._loop().call(handle.aclose)
    torch.cuda.synchronize()
