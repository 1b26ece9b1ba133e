"""Behaviour tests for the wire codec (:mod:`aiosync.core.wire`): bytes in, messages or errors out.

The one protocol: a session opens with Hello (protocol range, data plane) / Ready; each version
is Begin (manifest) -> Bucket (slots or specs) ... -> Complete -> Commit, every one acked.
"""

from __future__ import annotations

import ast
import inspect
import pickle
import typing
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

import aiosync.core.layout as layout
import aiosync.core.manifest as manifest
import aiosync.core.wire as wire
from aiosync.core.engine_actions import OpenPlane, Reply
from aiosync.core.engine_session import EngineSession
from aiosync.core.errors import AiosyncError, ProtocolError, RejectedError
from aiosync.core.layout import TensorSpec
from aiosync.core.manifest import TensorMeta
from aiosync.core.trainer_session import LinkSession
from aiosync.core.wire import (
    GOODBYE_SEQ,
    PROTOCOL,
    Abort,
    Ack,
    Begin,
    Bucket,
    Challenge,
    CollectivePlaneSpec,
    Commit,
    Complete,
    CudaLegacyPlaneSpec,
    CudaPlaneSpec,
    CudaRegion,
    DirectPlaneSpec,
    GatheredPlaneSpec,
    Goodbye,
    Hello,
    ManifestMemo,
    Ping,
    Ready,
    ShmHandle,
    ShmPlaneSpec,
    Slot,
    decode,
    encode,
)

CUDA_PLANE = CudaPlaneSpec(
    device=1,
    size=1 << 20,
    handles=[b"\x00\x01\x02ipc-handle\xff" + b"h" * 50, b"i" * 64],
    events=[b"event\x00" + b"e" * 58, b"f" * 64],
    counter=b"c" * 64,
    counter_word=7,
)

MANIFEST = [
    TensorMeta("model.layers.0.weight", "bfloat16", (16, 32)),
    TensorMeta("scalar", "float32", ()),
    TensorMeta("empty", "int8", (0, 3)),
    TensorMeta("big", "float32", (1000,), 8),
]

SPECS = [
    TensorSpec("model.layers.0.weight", "bfloat16", (16, 32), 0, 1024),
    TensorSpec("scalar", "float32", (), 1024, 4),
    TensorSpec("empty", "int8", (0, 3), 1536, 0),
    TensorSpec("big", "float32", (1000,), 1536, 512, 2048),
]

SLOTS = [Slot(0, 0, 1024), Slot(1, 1024, 4), Slot(2, 1536, 0), Slot(3, 1536, 512, 2048)]

SAMPLES: list[Any] = [
    Hello(
        PROTOCOL,
        PROTOCOL,
        "session-1",
        "trainer-0",
        ShmPlaneSpec([ShmHandle("aiosync-1-2-0123456789abcdef", 4096)]),
    ),
    Hello(
        1,
        7,
        "session-2",
        "trainer-1",
        CUDA_PLANE,
    ),
    Hello(0, 0, "", "", ShmPlaneSpec([])),
    Hello(2, 2, "s", "t", CudaPlaneSpec(1, 4096, [b"h" * 64, b"i" * 64])),  # no events
    Hello(
        2, 2, "s", "t", CollectivePlaneSpec("gloo", "127.0.0.1", 1234, "ab" * 16, "g", 3, 2, 4096)
    ),
    Hello(
        2,
        2,
        "s",
        "t",
        GatheredPlaneSpec(
            [ShmPlaneSpec([ShmHandle("a", 1024)]), CudaPlaneSpec(0, 2048, [b"h" * 64])]
        ),
    ),
    Hello(2, 2, "s", "t", DirectPlaneSpec(ShmPlaneSpec([ShmHandle("a", 1024)]), 1 << 30)),
    Hello(2, 2, "s", "t", DirectPlaneSpec(CudaPlaneSpec(0, 2048, [b"h" * 64]), 9, b"e" * 64)),
    Ready("session-1", PROTOCOL, None),
    Ready("session-1", 2, 0),
    Ready("session-1", 2, 2**62),
    Ready("session-1", 2, 3, events=[b"\x00" * 64, b"\xff" * 64]),
    Begin(0),
    Begin(3, []),
    Begin(7, MANIFEST),
    Begin(7, MANIFEST, first=Bucket(7, 1, 2, 2048, slots=SLOTS, regions=[ShmHandle("a", 1024)])),
    Bucket(0, 1, 0, 0),
    Bucket(7, 3, 1, 2048, slots=SLOTS),
    Bucket(7, 3, 1, 2048, specs=SPECS),
    Bucket(7, 4, 2, 2048, slots=SLOTS, regions=[ShmHandle("a", 1024), CudaRegion(b"h" * 64, 9)]),
    Complete(12, 3, 11, 400),
    Complete(0, 1, 0, 0),
    Commit(12, 5),
    Commit(0, 2),
    Ack(5, 1, True),
    Ack(6, 0, False, "tensor 'x' has the wrong shape", "x"),
    Ack(7, 2, False, "someone else is streaming; try again later", busy=True),
    Ack(None, GOODBYE_SEQ, True),
    Abort("trainer crashed"),
    Abort("cancelled", 9),
    Goodbye("session-1"),
    Goodbye("ünïcødé-sëssion"),
    Ping("session-1"),
    Challenge("0f1e2d3c4b5a6978", b"\x01" * 32),
]

#: Every type decode() may return: a corrupted frame can still be a valid message of any type.
MESSAGE_TYPES = typing.get_args(wire.Message)


def sample_id(msg: Any) -> str:
    return type(msg).__name__


# --------------------------------------------------------------------------------------
# round trip
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("msg", SAMPLES, ids=sample_id)
def test_round_trip(msg: Any) -> None:
    data = encode(msg)
    assert isinstance(data, bytes)
    got = decode(data)
    assert type(got) is type(msg)
    assert got == msg


@pytest.mark.parametrize("msg", SAMPLES, ids=sample_id)
def test_decode_accepts_memoryview(msg: Any) -> None:
    data = encode(msg)
    assert decode(memoryview(data)) == msg
    # a slice of a larger frame, as a zero-copy receive would hand over
    framed = memoryview(b"xx" + data + b"yy")[2:-2]
    assert decode(framed) == msg


def test_every_message_type_is_sampled() -> None:
    assert {type(m) for m in SAMPLES} == set(MESSAGE_TYPES)
    assert set(MESSAGE_TYPES) == {
        Hello,
        Ready,
        Begin,
        Bucket,
        Complete,
        Commit,
        Ack,
        Abort,
        Goodbye,
        Ping,
        Challenge,
    }
    planes = {type(m.plane) for m in SAMPLES if isinstance(m, Hello)}
    kinds = {ShmPlaneSpec, CudaPlaneSpec, CollectivePlaneSpec}
    kinds |= {GatheredPlaneSpec, DirectPlaneSpec}
    assert planes == set(typing.get_args(wire.PlaneSpec)) == kinds
    handles = {
        type(h)
        for m in SAMPLES
        if isinstance(m, Hello) and isinstance(m.plane, ShmPlaneSpec)
        for h in m.plane.buffers
    }
    assert handles == {ShmHandle}
    buckets = [m for m in SAMPLES if isinstance(m, Bucket)]
    assert any(b.slots for b in buckets)
    assert any(b.specs for b in buckets)
    assert any(isinstance(m, Begin) and m.manifest for m in SAMPLES)


def test_round_trip_keeps_tensor_spec_fields() -> None:
    msg = Bucket(7, 3, 1, 2048, specs=SPECS)
    got = decode(encode(msg))
    assert isinstance(got, Bucket)
    assert got.slots == []
    for a, b in zip(got.specs, msg.specs, strict=True):
        assert isinstance(a, TensorSpec)
        assert isinstance(a.shape, tuple)
        assert (a.name, a.dtype, a.shape, a.offset, a.nbytes, a.start) == (
            b.name,
            b.dtype,
            b.shape,
            b.offset,
            b.nbytes,
            b.start,
        )


def test_round_trip_keeps_slot_fields() -> None:
    got = decode(encode(Bucket(7, 3, 1, 2048, slots=SLOTS)))
    assert isinstance(got, Bucket)
    assert got.specs == []
    assert all(isinstance(slot, Slot) for slot in got.slots)
    assert [(s.entry, s.offset, s.nbytes, s.start) for s in got.slots] == [
        (0, 0, 1024, 0),
        (1, 1024, 4, 0),
        (2, 1536, 0, 0),
        (3, 1536, 512, 2048),
    ]


def test_round_trip_keeps_manifest_entries() -> None:
    got = decode(encode(Begin(7, MANIFEST)))
    assert isinstance(got, Begin)
    assert got.manifest is not None
    for a, b in zip(got.manifest, MANIFEST, strict=True):
        assert isinstance(a, TensorMeta)
        assert isinstance(a.shape, tuple)
        assert (a.name, a.dtype, a.shape, a.chunks) == (b.name, b.dtype, b.shape, b.chunks)
    # no manifest and an empty manifest are different things (a generator vs no tensors)
    assert decode(encode(Begin(3))).manifest is None  # type: ignore[union-attr]
    assert decode(encode(Begin(3, []))).manifest == []  # type: ignore[union-attr]


def test_round_trip_keeps_plane_and_handle_kinds() -> None:
    got = decode(encode(SAMPLES[1]))
    assert isinstance(got, Hello)
    assert isinstance(got.plane, CudaPlaneSpec)
    assert got.plane == CUDA_PLANE
    assert got.plane.sizes == [1 << 20, 1 << 20]
    unordered = decode(encode(SAMPLES[3]))
    assert isinstance(unordered, Hello)
    assert isinstance(unordered.plane, CudaPlaneSpec)
    assert (unordered.plane.events, unordered.plane.counter) == ([], b"")
    assert (got.protocol_min, got.protocol_max) == (1, 7)
    shm = decode(encode(SAMPLES[0]))
    assert isinstance(shm, Hello)
    assert isinstance(shm.plane, ShmPlaneSpec)
    assert shm.plane.sizes == [4096]


def test_defaults_filled_in() -> None:
    assert decode(encode(Ack(2, 3, True))) == Ack(2, 3, True, None, None, False)
    assert decode(encode(Abort("r"))) == Abort("r", None)
    assert decode(encode(Begin(4))) == Begin(4, None)
    bucket = decode(encode(Bucket(0, 1, 0, 512, slots=[Slot(0, 0, 1)])))
    assert isinstance(bucket, Bucket)
    assert bucket.slots[0].start == 0
    assert bucket.specs == []
    spec = decode(encode(Bucket(0, 1, 0, 512, specs=[TensorSpec("a", "uint8", (1,), 0, 1)])))
    assert isinstance(spec, Bucket)
    assert spec.specs[0].start == 0
    meta = decode(encode(Begin(1, [TensorMeta("a", "uint8", (1,))])))
    assert isinstance(meta, Begin)
    assert meta.manifest == [TensorMeta("a", "uint8", (1,), 1)]


# --------------------------------------------------------------------------------------
# the encoding is plain msgpack (never pickle)
# --------------------------------------------------------------------------------------

PLAIN = (dict, list, str, int, bool, bytes, type(None))


def assert_plain(obj: Any) -> None:
    assert isinstance(obj, PLAIN), type(obj)
    if isinstance(obj, dict):
        for key, value in obj.items():
            assert isinstance(key, str)
            assert_plain(value)
    elif isinstance(obj, list):
        for value in obj:
            assert_plain(value)


@pytest.mark.parametrize("msg", SAMPLES, ids=sample_id)
def test_encoding_is_plain_msgpack(msg: Any) -> None:
    data = encode(msg)
    plain = msgspec.msgpack.decode(data)
    assert_plain(plain)
    assert isinstance(plain, dict)
    assert plain["type"] == type(msg).__struct_config__.tag
    assert not data.startswith(b"\x80")  # pickle protocol >= 2 header


def test_wire_format_is_documented_map() -> None:
    assert msgspec.msgpack.decode(encode(Ack(3, 4, False, "bad", "w"))) == {
        "type": "ack",
        "version": 3,
        "seq": 4,
        "ok": False,
        "error": "bad",
        "tensor": "w",
        "busy": False,
    }
    plain = msgspec.msgpack.decode(encode(Bucket(7, 3, 1, 2048, specs=SPECS)))
    assert plain["type"] == "bucket"
    # tensor specs and slots travel as compact arrays
    assert plain["specs"][3] == ["big", "float32", [1000], 1536, 512, 2048]
    plain = msgspec.msgpack.decode(encode(Bucket(7, 3, 1, 2048, slots=SLOTS)))
    assert plain["slots"][3] == [3, 1536, 512, 2048]
    assert plain["specs"] == []
    plain = msgspec.msgpack.decode(encode(Begin(7, MANIFEST)))
    assert plain == {
        "type": "begin",
        "version": 7,
        "manifest": [
            ["model.layers.0.weight", "bfloat16", [16, 32], 1],
            ["scalar", "float32", [], 1],
            ["empty", "int8", [0, 3], 1],
            ["big", "float32", [1000], 8],
        ],
        "empty": False,
        "rebase": False,
        "first": None,
    }
    assert msgspec.msgpack.decode(encode(SAMPLES[0])) == {
        "type": "hello",
        "protocol_min": PROTOCOL,
        "protocol_max": PROTOCOL,
        "session": "session-1",
        "sender": "trainer-0",
        "plane": {
            "type": "shm",
            "buffers": [{"type": "shm", "name": "aiosync-1-2-0123456789abcdef", "size": 4096}],
        },
    }
    assert msgspec.msgpack.decode(encode(SAMPLES[1]))["plane"]["type"] == "cuda"
    assert msgspec.msgpack.decode(encode(Commit(12, 5))) == {
        "type": "commit",
        "version": 12,
        "seq": 5,
    }


def test_hand_built_msgpack_decodes() -> None:
    """A peer written in another language only needs msgpack, not this package."""
    data = msgspec.msgpack.encode(
        {"type": "complete", "seq": 3, "version": 2, "buckets": 1, "tensors": 5}
    )
    assert decode(data) == Complete(2, 3, 1, 5)
    data = msgspec.msgpack.encode(
        {
            "type": "bucket",
            "seq": 1,
            "version": 1,
            "buffer": 0,
            "used": 512,
            "specs": [["w", "float32", [2, 2], 0, 16]],
        }
    )
    assert decode(data) == Bucket(1, 1, 0, 512, specs=[TensorSpec("w", "float32", (2, 2), 0, 16)])
    data = msgspec.msgpack.encode(
        {"type": "bucket", "seq": 1, "version": 1, "buffer": 0, "used": 512, "slots": [[0, 0, 16]]}
    )
    assert decode(data) == Bucket(1, 1, 0, 512, slots=[Slot(0, 0, 16, 0)])
    data = msgspec.msgpack.encode(
        {"type": "begin", "version": 1, "manifest": [["w", "float32", [2, 2]]]}
    )
    assert decode(data) == Begin(1, [TensorMeta("w", "float32", (2, 2), 1)])
    data = msgspec.msgpack.encode(
        {
            "type": "hello",
            "protocol_min": 2,
            "protocol_max": 3,
            "session": "s",
            "sender": "t",
            "plane": {"type": "shm", "buffers": [{"type": "shm", "name": "b", "size": 512}]},
        }
    )
    assert decode(data) == Hello(2, 3, "s", "t", ShmPlaneSpec([ShmHandle("b", 512)]))
    data = msgspec.msgpack.encode({"type": "ack", "version": None, "seq": -1, "ok": True})
    assert decode(data) == Ack(None, GOODBYE_SEQ, True)


def test_codec_never_calls_pickle(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("pickle used")

    for name in ("dumps", "loads", "dump", "load"):
        monkeypatch.setattr(pickle, name, boom)
    for msg in SAMPLES:
        assert decode(encode(msg)) == msg


@pytest.mark.parametrize("module", [wire, manifest, layout], ids=lambda m: m.__name__)
def test_wire_modules_do_not_import_pickle(module: Any) -> None:
    tree = ast.parse(inspect.getsource(module))
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"pickle", "cloudpickle", "dill", "marshal", "shelve"}


def test_pickled_message_is_rejected() -> None:
    data = pickle.dumps({"type": "ack", "version": 1, "seq": 1, "ok": True})
    with pytest.raises(ProtocolError):
        decode(data)


# --------------------------------------------------------------------------------------
# malformed input -> ProtocolError
# --------------------------------------------------------------------------------------


def assert_rejected(data: bytes) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode(data)
    assert isinstance(info.value, AiosyncError)
    assert str(len(data)) in str(info.value)
    return info.value


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # never-used msgpack opcode
        b"\x00",
        b"\xff",
        b"\x90",  # empty array
        b"\x80",  # empty map
        b"\xc0",  # nil
        b"\xa5hello",  # a bare string
        b"hello world",
        b"\x00" * 64,
        b"\xdd\xff\xff\xff\xff",  # array claiming 4G entries
        b"\xdf\xff\xff\xff\xff",  # map claiming 4G entries
        b"\x91" * 10_000,  # deeply nested arrays at top level
        b'{"type": "ack", "version": 1, "seq": 1, "ok": true}',  # JSON is not msgpack
    ],
    ids=lambda data: repr(data[:12]) + f"..{len(data)}",
)
def test_garbage_is_protocol_error(data: bytes) -> None:
    assert_rejected(data)


@pytest.mark.parametrize("depth", [100, 900, 1_000, 2_000, 10_000])
def test_deeply_nested_unknown_field_is_protocol_error(depth: int) -> None:
    # msgspec skips unknown fields recursively; past Python's recursion limit it raises
    # RecursionError, which decode() must turn into ProtocolError (a ~1 KB frame from any
    # peer must not escape the ProtocolError contract).
    nested = b"\x91" * depth + b"\xc0"  # [[[...[nil]...]]]
    assert_rejected(b"\x81\xa1x" + nested)  # {"x": [[[...]]]} (no tag yet)
    # a valid ack plus one nested extra field: unknown fields are ignored, so this may
    # decode to the ack, but it must never raise anything other than ProtocolError
    ack_fields = b"\xa4type\xa3ack\xa7version\xc0\xa3seq\x01\xa2ok\xc3"
    assert decode(b"\x84" + ack_fields) == Ack(None, 1, True)
    try:
        got = decode(b"\x85" + ack_fields + b"\xa5extra" + nested)
    except ProtocolError:
        return
    assert got == Ack(None, 1, True)


@pytest.mark.parametrize("msg", SAMPLES, ids=sample_id)
def test_every_truncation_is_protocol_error(msg: Any) -> None:
    data = encode(msg)
    for end in range(len(data)):
        assert_rejected(data[:end])


@pytest.mark.parametrize("msg", SAMPLES, ids=sample_id)
def test_trailing_bytes_are_protocol_error(msg: Any) -> None:
    data = encode(msg)
    assert_rejected(data + b"\x00")
    assert_rejected(data + data)


def enc(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


ACK = {"type": "ack", "version": 1, "seq": 1, "ok": True}
BUCKET = {
    "type": "bucket",
    "seq": 1,
    "version": 1,
    "buffer": 0,
    "used": 512,
    "specs": [["w", "float32", [4], 0, 16, 0]],
}
SLOTTED = {
    "type": "bucket",
    "seq": 1,
    "version": 1,
    "buffer": 0,
    "used": 512,
    "slots": [[0, 0, 16]],
}
BEGIN = {"type": "begin", "version": 1, "manifest": [["w", "float32", [4], 1]]}
SHM_PLANE = {"type": "shm", "buffers": [{"type": "shm", "name": "b", "size": 512}]}
HELLO = {
    "type": "hello",
    "protocol_min": PROTOCOL,
    "protocol_max": PROTOCOL,
    "session": "s",
    "sender": "t",
    "plane": SHM_PLANE,
}
READY = {"type": "ready", "session": "s", "protocol": PROTOCOL, "version": 1}
COMPLETE = {"type": "complete", "seq": 2, "version": 1, "buckets": 1, "tensors": 1}
COMMIT = {"type": "commit", "seq": 3, "version": 1}


def with_(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out = dict(base)
    out.update(changes)
    return out


def without(base: dict[str, Any], key: str) -> dict[str, Any]:
    out = dict(base)
    del out[key]
    return out


def test_fixtures_are_valid() -> None:
    expected = [
        (ACK, Ack),
        (BUCKET, Bucket),
        (SLOTTED, Bucket),
        (BEGIN, Begin),
        (HELLO, Hello),
        (READY, Ready),
        (COMPLETE, Complete),
        (COMMIT, Commit),
    ]
    for obj, kind in expected:
        assert isinstance(decode(enc(obj)), kind)


@pytest.mark.parametrize(
    "tag",
    ["pickle", "Ack", "ACK", "", "shm", "cuda", "cuda_ipc", "bucket2", "tensor_spec", "slot"],
)
def test_unknown_tag_is_protocol_error(tag: str) -> None:
    err = assert_rejected(enc(with_(ACK, type=tag)))
    assert "type" in str(err)


@pytest.mark.parametrize("tag", [1, None, True, ["ack"], b"ack"])
def test_non_string_tag_is_protocol_error(tag: Any) -> None:
    assert_rejected(enc(with_(ACK, type=tag)))


def test_missing_tag_is_protocol_error() -> None:
    assert_rejected(enc(without(ACK, "type")))


def test_top_level_array_is_protocol_error() -> None:
    assert_rejected(enc(["ack", 1, 1, True]))
    assert_rejected(enc(list(ACK.values())))


@pytest.mark.parametrize(
    "obj",
    [
        with_(ACK, seq="1"),
        with_(ACK, seq=1.0),
        with_(ACK, seq=True),
        with_(ACK, seq=None),
        with_(ACK, version="1"),
        with_(ACK, version=1.5),
        with_(ACK, ok=1),
        with_(ACK, ok="yes"),
        with_(ACK, ok=None),
        with_(ACK, error=5),
        with_(ACK, tensor=["x"]),
        with_(ACK, busy="yes"),
        with_(ACK, busy=None),
        with_(BUCKET, version="1"),
        with_(BUCKET, used=512.0),
        with_(BUCKET, specs={"w": 1}),
        with_(BUCKET, specs=[{"name": "w"}]),
        with_(BUCKET, specs=[["w", "float32", 4, 0, 16]]),  # shape not an array
        with_(BUCKET, specs=[["w", "float32", [4.0], 0, 16]]),
        with_(BUCKET, specs=[["w", 7, [4], 0, 16]]),
        with_(BUCKET, specs=[[b"w", "float32", [4], 0, 16]]),
        with_(BUCKET, specs=[["w", "float32", [4], "0", 16]]),
        with_(BUCKET, specs=[["w", "float32", [4], 0]]),  # too short
        with_(BUCKET, specs=["w"]),
        with_(BUCKET, specs=None),
        with_(SLOTTED, slots=None),
        with_(SLOTTED, slots={"entry": 0}),
        with_(SLOTTED, slots=[[0, 0]]),  # too short
        with_(SLOTTED, slots=[["0", 0, 16]]),
        with_(SLOTTED, slots=[[0, 0, 16.0]]),
        with_(SLOTTED, slots=[{"entry": 0, "offset": 0, "nbytes": 16}]),
        with_(SLOTTED, slots=[0]),
        with_(BEGIN, version=None),
        with_(BEGIN, version="1"),
        with_(BEGIN, manifest={"w": ["float32", [4]]}),
        with_(BEGIN, manifest=[["w", "float32", 4]]),  # shape not an array
        with_(BEGIN, manifest=[["w", "float32", [4], "1"]]),
        with_(BEGIN, manifest=[["w", "float32"]]),  # too short
        with_(BEGIN, manifest=[[1, "float32", [4]]]),
        with_(BEGIN, manifest=[{"name": "w", "dtype": "float32", "shape": [4]}]),
        with_(HELLO, protocol_min="1"),
        with_(HELLO, protocol_max=None),
        with_(HELLO, session=1),
        with_(HELLO, sender=None),
        with_(HELLO, plane=[SHM_PLANE]),
        with_(HELLO, plane=None),
        with_(HELLO, plane={"type": "tcp", "buffers": []}),
        with_(HELLO, plane={"buffers": []}),  # a plane needs its tag
        with_(HELLO, plane={"type": "shm", "buffers": {"type": "shm", "name": "b", "size": 512}}),
        with_(HELLO, plane={"type": "shm", "buffers": [{"type": "shm", "name": "b", "size": "5"}]}),
        with_(HELLO, plane={"type": "shm", "buffers": [{"type": "tcp", "name": "b", "size": 5}]}),
        with_(HELLO, plane={"type": "shm", "buffers": [["shm", "b", 512]]}),
        with_(HELLO, plane={"type": "shm", "buffers": [{"type": "cuda", "device": 0}]}),
        # a CUDA handle in a shared-memory plane (and the other way round) is not a plane
        with_(HELLO, plane={"type": "shm", "buffers": [msgspec.to_builtins(CUDA_PLANE)]}),
        with_(HELLO, plane={"type": "cuda", "buffers": SHM_PLANE["buffers"]}),
        with_(READY, version="3"),
        with_(READY, version=1.5),
        with_(READY, protocol=None),
        with_(READY, protocol="2"),
        with_(COMPLETE, buckets="1"),
        with_(COMPLETE, seq=None),
        with_(COMMIT, version=None),
        with_(COMMIT, seq="3"),
        {"type": "abort", "reason": None},
        {"type": "abort", "reason": "r", "version": "1"},
        {"type": "goodbye", "session": 1},
        {"type": "ping", "session": None},
    ],
)
def test_wrong_field_types_are_protocol_error(obj: dict[str, Any]) -> None:
    assert_rejected(enc(obj))


@pytest.mark.parametrize(
    ("base", "key"),
    [
        (ACK, "version"),
        (ACK, "seq"),
        (ACK, "ok"),
        (BUCKET, "seq"),
        (BUCKET, "version"),
        (BUCKET, "buffer"),
        (BUCKET, "used"),
        (BEGIN, "version"),
        (HELLO, "protocol_min"),
        (HELLO, "protocol_max"),
        (HELLO, "session"),
        (HELLO, "sender"),
        (HELLO, "plane"),
        (READY, "session"),
        (READY, "protocol"),
        (READY, "version"),
        (COMPLETE, "version"),
        (COMPLETE, "seq"),
        (COMPLETE, "tensors"),
        (COMPLETE, "buckets"),
        (COMMIT, "version"),
        (COMMIT, "seq"),
        ({"type": "abort", "reason": "r", "version": 1}, "reason"),
        ({"type": "goodbye", "session": "s"}, "session"),
        ({"type": "ping", "session": "s"}, "session"),
    ],
)
def test_missing_fields_are_protocol_error(base: dict[str, Any], key: str) -> None:
    err = assert_rejected(enc(without(base, key)))
    assert key in str(err)


def test_missing_plane_or_handle_field_is_protocol_error() -> None:
    assert_rejected(enc(with_(HELLO, plane={"type": "shm"})))
    assert_rejected(enc(with_(HELLO, plane={"type": "shm", "buffers": [{"type": "shm"}]})))
    for key in ("name", "size"):
        handle = without(SHM_PLANE["buffers"][0], key)
        err = assert_rejected(enc(with_(HELLO, plane={"type": "shm", "buffers": [handle]})))
        assert key in str(err)
    cuda = msgspec.msgpack.decode(encode(CUDA_PLANE))
    for key in ("device", "size", "handles"):  # events, counter and its word may be left out
        err = assert_rejected(enc(with_(HELLO, plane=without(cuda, key))))
        assert key in str(err)


@pytest.mark.parametrize("tag", ["cuda_ipc", "cuda_legacy"])
def test_the_two_plane_builds_cuda_tags_are_refused(tag: str) -> None:
    """One CUDA plane, tagged ``cuda``: a hello naming the old planes' tags is refused."""
    cuda = msgspec.msgpack.decode(encode(CUDA_PLANE))
    err = assert_rejected(enc(with_(HELLO, plane={**cuda, "type": tag})))
    assert "type" in str(err)
    assert CudaLegacyPlaneSpec is CudaPlaneSpec  # the old name still imports


def test_uint64_max_decodes_as_a_number() -> None:
    # uint64 max is valid msgpack; Python ints are unbounded, so it decodes as a number
    data = b"\x84\xa4type\xa3ack\xa7version\x01\xa3seq\xcf" + b"\xff" * 8 + b"\xa2ok\xc3"
    got = decode(data)
    assert isinstance(got, Ack)
    assert got.seq == 2**64 - 1


# --------------------------------------------------------------------------------------
# property: arbitrary bytes give a message or a ProtocolError, never anything else
# --------------------------------------------------------------------------------------


def test_message_types_are_every_wire_message() -> None:
    assert set(MESSAGE_TYPES) == {type(m) for m in SAMPLES}
    assert all(isinstance(t, type) and issubclass(t, msgspec.Struct) for t in MESSAGE_TYPES)


@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_raise_anything_else(data: bytes) -> None:
    try:
        msg = decode(data)
    except ProtocolError:
        return
    assert isinstance(msg, MESSAGE_TYPES)


@pytest.mark.parametrize("msg", SAMPLES, ids=sample_id)
@given(pos=st.integers(0, 10_000), value=st.integers(0, 255))
def test_corrupted_byte_never_raises_anything_else(msg: Any, pos: int, value: int) -> None:
    original = encode(msg)
    data = bytearray(original)
    data[pos % len(data)] = value
    try:
        got = decode(bytes(data))
    except ProtocolError:
        return
    # A changed byte may leave a valid message of the same type (a Ping with another
    # session name) or, in principle, of another type; an unchanged frame decodes as sent.
    assert isinstance(got, MESSAGE_TYPES)
    if bytes(data) == original:
        assert got == msg


# --------------------------------------------------------------------------------------
# protocol ranges: both sides state what they speak; no overlap is a clear refusal
# --------------------------------------------------------------------------------------

PEER = "trainer-0"


def engine_session() -> EngineSession:
    return EngineSession(expectations=None, staged=True, stream_timeout=60, session_timeout=60)


def hello(low: int, high: int) -> Hello:
    plane = ShmPlaneSpec([ShmHandle("aiosync-1-2-0123456789abcdef", 4096)])
    return Hello(low, high, "session-1", "trainer", plane)


@pytest.mark.parametrize(
    ("low", "high"),
    [(PROTOCOL + 1, PROTOCOL + 3), (0, PROTOCOL - 1), (2, PROTOCOL - 1), (PROTOCOL + 5, 99)],
    ids=["newer", "older", "older-build", "far-newer"],
)
def test_hello_with_a_disjoint_protocol_range_is_refused_naming_both(low: int, high: int) -> None:
    engine = engine_session()
    actions = engine.receive(PEER, hello(low, high), now=0.0)
    # refused in one reply, without opening the plane or a session
    assert len(actions) == 1
    reply = actions[0]
    assert isinstance(reply, Reply)
    assert reply.peer == PEER
    assert isinstance(reply.message, Abort)
    assert f"the sender speaks protocols {low}-{high}" in reply.message.reason
    assert f"this engine protocol {PROTOCOL} " in reply.message.reason
    assert not any(isinstance(a, OpenPlane) for a in actions)
    assert engine.sessions == {}
    assert engine.protocol_errors == 1
    # the refusal survives the wire, and the engine takes a good hello afterwards
    assert decode(encode(reply.message)) == reply.message
    actions = engine.receive(PEER, hello(PROTOCOL, PROTOCOL), now=1.0)
    assert [type(a) for a in actions] == [OpenPlane]


def test_a_wider_range_agrees_on_the_one_protocol() -> None:
    engine = engine_session()
    actions = engine.receive(PEER, hello(0, PROTOCOL + 10), now=0.0)
    assert [type(a) for a in actions] == [OpenPlane]
    (ready,) = engine.plane_opened(PEER)
    assert isinstance(ready, Reply)
    assert isinstance(ready.message, Ready)
    assert ready.message.protocol == PROTOCOL
    assert ready.message.session == "session-1"
    assert ready.message.version is None
    # and the sender's side accepts it
    link = LinkSession("engine-0", "session-1")
    link.ready(ready.message)
    assert link.protocol == PROTOCOL


def test_follow_opens_a_version_the_engine_will_refuse_and_begin_does_not() -> None:
    link = LinkSession("engine-0", "session-1")
    with pytest.raises(ProtocolError, match="before the session is ready"):
        link.follow(3)
    link.ready(Ready("session-1", PROTOCOL, 5))
    with pytest.raises(RejectedError, match="not newer than the engine's 5"):
        link.begin(3)  # a refusal, not a broken session: the engine stays in the fleet
    link.sent(0)
    link.follow(3)  # a collective plane's engine joins the broadcasts of a version it refuses
    assert (link.version, link.in_flight, link.remote_version) == (3, 0, 5)


@pytest.mark.parametrize("protocol", [PROTOCOL - 1, PROTOCOL + 1, 0])
def test_sender_refuses_a_ready_outside_its_range_naming_both(protocol: int) -> None:
    link = LinkSession("engine-0", "session-1")
    hello_message = link.hello("trainer", ShmPlaneSpec([ShmHandle("x", 512)]))
    assert (hello_message.protocol_min, hello_message.protocol_max) == (PROTOCOL, PROTOCOL)
    with pytest.raises(ProtocolError) as info:
        link.ready(Ready("session-1", protocol, None))
    message = str(info.value)
    assert f"protocol {protocol}" in message
    assert f"this sender speaks protocol {PROTOCOL} " in message
    assert "engine-0" in message
    assert link.protocol is None


# --------------------------------------------------------------------------------------
# ManifestMemo: decode, with the last begin's manifest kept by its bytes
# --------------------------------------------------------------------------------------


def memo_outcome(memo: ManifestMemo, data: bytes) -> Any:
    """What decoding ``data`` gives: the message, or ProtocolError (the type)."""
    try:
        return memo.decode(data)
    except ProtocolError:
        return ProtocolError


def plain_outcome(data: bytes) -> Any:
    try:
        return decode(data)
    except ProtocolError:
        return ProtocolError


@pytest.mark.parametrize("msg", SAMPLES, ids=sample_id)
def test_the_memo_decodes_every_message_as_decode_does(msg: Any) -> None:
    memo, data = ManifestMemo(), encode(msg)
    assert memo.decode(data) == msg
    assert memo.decode(memoryview(data)) == msg  # again, from what it kept if a begin
    for end in range(len(data)):
        assert memo_outcome(memo, data[:end]) is ProtocolError
    assert memo_outcome(memo, data + b"\x00") is ProtocolError


@pytest.mark.parametrize("msg", SAMPLES, ids=sample_id)
@given(pos=st.integers(0, 10_000), value=st.integers(0, 255))
def test_the_memo_agrees_with_decode_on_corrupted_bytes(msg: Any, pos: int, value: int) -> None:
    data = bytearray(encode(msg))
    data[pos % len(data)] = value
    memo = ManifestMemo()
    memo.decode(encode(Begin(7, MANIFEST)))  # a manifest kept: the corrupted one may differ
    assert memo_outcome(memo, bytes(data)) == plain_outcome(bytes(data))


@given(st.binary(max_size=200))
def test_the_memo_agrees_with_decode_on_arbitrary_bytes(data: bytes) -> None:
    assert memo_outcome(ManifestMemo(), data) == plain_outcome(data)


def begin_of(memo: ManifestMemo, message: Begin, accept: bool = True) -> Begin:
    """``message`` through ``memo``, then decided: accepted (kept) or refused."""
    got = memo.decode(encode(message))
    assert isinstance(got, Begin)
    memo.settle(got.manifest if accept else None)
    return got


def test_an_unchanged_accepted_manifest_is_the_list_decoded_before_and_one_is_kept() -> None:
    memo = ManifestMemo()
    first = begin_of(memo, Begin(1, MANIFEST))
    again = begin_of(memo, Begin(2, MANIFEST, rebase=True))
    assert again.manifest is first.manifest  # not decoded again
    assert (again.version, again.rebase) == (2, True)
    other = begin_of(memo, Begin(3, MANIFEST[:2]))
    assert other.manifest == MANIFEST[:2]
    back = begin_of(memo, Begin(4, MANIFEST))
    assert back.manifest == MANIFEST
    assert back.manifest is not first.manifest  # only the last manifest is kept
    bad = msgspec.msgpack.encode({"type": "begin", "version": 5, "manifest": [["a", 3, [1], 1]]})
    assert memo_outcome(memo, bad) is ProtocolError  # an entry's dtype is not a string
    memo.settle(None)
    assert begin_of(memo, Begin(6, MANIFEST)).manifest is back.manifest  # nothing replaced


def test_a_refused_or_undecided_manifest_is_never_kept() -> None:
    memo = ManifestMemo()
    kept = begin_of(memo, Begin(1, MANIFEST))
    refused = begin_of(memo, Begin(2, MANIFEST[:1]), accept=False)  # a peer's, refused
    assert refused.manifest == MANIFEST[:1]
    assert begin_of(memo, Begin(3, MANIFEST[:1])).manifest is not refused.manifest
    undecided = memo.decode(encode(Begin(4, MANIFEST[:3])))  # no decision followed
    assert isinstance(undecided, Begin)
    memo.decode(encode(Ping("s")))
    memo.settle(undecided.manifest)  # too late: another message came between
    again = begin_of(memo, Begin(5, MANIFEST[:3]))
    assert again.manifest is not undecided.manifest
    assert kept.manifest == MANIFEST
