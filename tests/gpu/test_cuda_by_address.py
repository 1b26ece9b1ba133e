"""Copies queued by address on a GPU (issue 10, performance); needs one, skips without.

The trainer's pack into its own CUDA buffer and an engine's copy programs for CUDA buckets
queue ``cudaMemcpyAsync`` by address instead of ``copy_``: the same bytes, checked here
against the per-tensor paths, with the tensors those paths still take (another device,
not contiguous, a chunk, empty) and a target given new storage between two buckets.
"""

from __future__ import annotations

import pytest
import torch

from aiosync.core.layout import TensorSpec, dtype_name, pack_bucket, plan_buckets, tensor_bytes
from tests.conftest import requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]


def sources() -> dict[str, torch.Tensor]:
    """Tensors of every kind the pack meets (seeded, on ``cuda:0`` unless said)."""
    gen = torch.Generator(device="cuda:0").manual_seed(3)
    big = torch.randn(3000, generator=gen, device="cuda:0")
    return {
        "plain.bf16": torch.randn(64, 33, generator=gen, device="cuda:0").to(torch.bfloat16),
        "offset.view": big[7:1031],  # a storage offset
        "transposed": torch.randn(16, 24, generator=gen, device="cuda:0").t(),
        "on.cpu": torch.arange(100, dtype=torch.int32),
        "empty": torch.empty(0, device="cuda:0"),
        "oversized": torch.randn(5000, generator=gen, device="cuda:0"),  # chunked
        "int8": torch.randint(-100, 100, (77,), dtype=torch.int8, device="cuda:0"),
    }


def test_pack_by_address_writes_what_pack_bucket_writes() -> None:
    from aiosync.planes.cuda import _pack
    from aiosync.planes.cuda_copies import DeviceCopies
    from aiosync.planes.cuda_runtime import DeviceMemory

    capacity = 8192
    tensors = sources()
    memory = DeviceMemory.allocate(capacity, 0)
    try:
        reference = torch.zeros(capacity, dtype=torch.uint8, device="cuda:0")
        plans = list(plan_buckets(tensors.items(), capacity))
        assert len(plans) > 2  # the oversized tensor went in chunks
        for plan in plans:
            _pack(memory, plan, torch.cuda.current_stream(), DeviceCopies(0))
            pack_bucket(reference, plan)
            torch.cuda.synchronize()
            for spec in plan.specs:
                span = slice(spec.offset, spec.offset + spec.nbytes)
                assert torch.equal(memory.tensor[span], reference[span]), spec.name
    finally:
        memory.close()


def specs_for(targets: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[TensorSpec]]:
    """A CUDA bucket of random bytes holding one spec per target, 64-byte aligned."""
    specs, offset = [], 0
    for name, target in targets.items():
        spec = TensorSpec(
            name, dtype_name(target.dtype), tuple(target.shape), offset, target.nbytes
        )
        specs.append(spec)
        offset += (target.nbytes + 63) // 64 * 64
    gen = torch.Generator(device="cuda:0").manual_seed(5)
    bucket = torch.randint(0, 256, (offset,), dtype=torch.uint8, device="cuda:0", generator=gen)
    return bucket, specs


def test_a_cuda_copy_program_copies_each_target_and_is_remade_for_new_storage() -> None:
    from aiosync.engine.bulk_apply import CopyPrograms

    targets = {
        "a": torch.zeros(1000, dtype=torch.bfloat16, device="cuda:0"),
        "b": torch.zeros(33, 7, device="cuda:0"),
        "host": torch.zeros(50, dtype=torch.int16),  # not on the bucket's device: left over
        "c": torch.zeros(300, dtype=torch.int8, device="cuda:0"),
    }
    bucket, specs = specs_for(targets)
    programs = CopyPrograms()
    rest = programs.apply(bucket, specs, lambda spec: targets[spec.name])
    assert [spec.name for spec in rest] == ["host"]
    torch.cuda.synchronize()
    for spec in specs:
        if spec.name != "host":
            raw = bucket[spec.offset : spec.offset + spec.nbytes]
            assert torch.equal(tensor_bytes(targets[spec.name]), raw), spec.name

    old = targets["b"]
    old.data = torch.zeros_like(old)  # new storage: the program stops there and is remade
    rest = programs.apply(bucket, specs, lambda spec: targets[spec.name])
    assert [spec.name for spec in rest][:1] == ["b"]
    assert "host" in [spec.name for spec in rest]
    rest = programs.apply(bucket, specs, lambda spec: targets[spec.name])  # remade
    assert [spec.name for spec in rest] == ["host"]
    torch.cuda.synchronize()
    assert torch.equal(
        tensor_bytes(targets["b"]), bucket[specs[1].offset : specs[1].offset + specs[1].nbytes]
    )


def test_a_module_sink_applies_a_bucket_of_several_cuda_parts_in_one_call() -> None:
    """A direct bucket's regions (several CUDA views) through ``apply_parts``: one call,
    bit-exact, again after a target got new storage and from parts at other addresses."""
    from aiosync import ModuleSink
    from aiosync.core.layout import calculate_aligned_size
    from aiosync.engine.sinks import apply_parts

    gen = torch.Generator(device="cuda:0").manual_seed(5)
    sent = {
        f"t{i}": torch.randn(40 + i, 8, generator=gen, device="cuda:0").to(torch.bfloat16)
        for i in range(24)
    }
    sent["host"] = torch.arange(12, dtype=torch.float32, device="cuda:0")
    targets = {name: torch.zeros_like(t) for name, t in sent.items()}
    targets["host"] = torch.zeros(12)  # on the CPU: copied spec by spec
    parts = []
    for k in range(3):
        names = list(sent)[k::3]
        region = torch.zeros(
            sum(calculate_aligned_size(sent[n].nbytes) for n in names),
            dtype=torch.uint8,
            device="cuda:0",
        )
        specs, offset = [], 0
        for name in names:
            t = sent[name]
            region[offset : offset + t.nbytes] = tensor_bytes(t)
            specs.append(TensorSpec(name, dtype_name(t.dtype), tuple(t.shape), offset, t.nbytes))
            offset += calculate_aligned_size(t.nbytes)
        parts.append((region, specs))
    sink = ModuleSink(targets)
    sink.expectations()

    def check() -> None:
        torch.cuda.synchronize()
        for name, t in sent.items():
            assert torch.equal(targets[name].to(t.device), t), name

    apply_parts(sink, parts)
    check()
    targets["t4"].data = torch.zeros_like(targets["t4"])
    apply_parts(sink, parts)
    check()
    apply_parts(sink, [(region.clone(), specs) for region, specs in parts])
    check()
