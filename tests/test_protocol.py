"""Behaviour tests for the session state machines (:mod:`aiosync.protocol`).

In the spirit of h11: feed messages in, check replies, state and errors out. No IO.
"""

from __future__ import annotations

import pytest

from aiosync.errors import AiosyncError, ProtocolError, RejectedError
from aiosync.layout import TensorSpec, plan_buckets
from aiosync.protocol import Phase, ReceiverProtocol, SenderProtocol
from aiosync.wire import (
    PROTOCOL_VERSION,
    Abort,
    Ack,
    Bucket,
    Complete,
    CudaIpcHandle,
    Goodbye,
    Hello,
    Ready,
    ShmHandle,
    decode,
    encode,
)

PEER = "trainer-0"
SESSION = "session-abc"
BUF = 4096


def hello(
    *, session: str = SESSION, protocol: int = PROTOCOL_VERSION, sizes: tuple[int, ...] = (BUF, BUF)
) -> Hello:
    return Hello(protocol, session, PEER, [ShmHandle(f"/buf{i}", s) for i, s in enumerate(sizes)])


def whole(name: str, offset: int = 0, n: int = 4) -> TensorSpec:
    """A whole float32 tensor of ``n`` elements at ``offset``."""
    return TensorSpec(name, "float32", (n,), offset, 4 * n)


def chunk(name: str, start: int, nbytes: int, total: int) -> TensorSpec:
    """A byte range of a ``total``-byte uint8 tensor, at offset 0."""
    return TensorSpec(name, "uint8", (total,), 0, nbytes, start)


def bucket(seq: int, version: int, specs: list[TensorSpec], buffer: int = 0) -> Bucket:
    used = 0
    for s in specs:
        used = max(used, -(-(s.offset + s.nbytes) // 512) * 512)
    return Bucket(seq, version, buffer, used, specs)


def opened(current_version: int | None = None) -> ReceiverProtocol:
    r = ReceiverProtocol(PEER, current_version)
    r.hello(hello())
    return r


def apply(r: ReceiverProtocol, msg: Bucket) -> Ack:
    r.check_bucket(msg)
    return r.bucket_applied(msg)


def commit(r: ReceiverProtocol, msg: Complete) -> Ack:
    r.check_complete(msg)
    return r.committed(msg)


# --------------------------------------------------------------------------------------
# receiver: handshake
# --------------------------------------------------------------------------------------


def test_receiver_starts_in_handshake() -> None:
    r = ReceiverProtocol(PEER)
    assert r.phase is Phase.HANDSHAKE
    assert r.current_version is None
    assert r.stream is None


@pytest.mark.parametrize("current", [None, 0, 7])
def test_hello_returns_ready(current: int | None) -> None:
    r = ReceiverProtocol(PEER, current)
    reply = r.hello(hello(sizes=(1024, 2048, 512)))
    assert reply == Ready(session=SESSION, version=current)
    assert r.phase is Phase.IDLE
    assert r.session == SESSION
    assert r.buffer_sizes == [1024, 2048, 512]


def test_hello_with_cuda_handles() -> None:
    r = ReceiverProtocol(PEER)
    handle = CudaIpcHandle(0, b"h", 8192, 0, b"r", 0, None, False, 8192)
    r.hello(Hello(PROTOCOL_VERSION, SESSION, PEER, [handle]))
    assert r.buffer_sizes == [8192]


def test_hello_without_buffers_is_error() -> None:
    r = ReceiverProtocol(PEER)
    with pytest.raises(ProtocolError, match="no buffers"):
        r.hello(hello(sizes=()))
    assert r.phase is Phase.HANDSHAKE


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION + 1, -1, 999])
def test_wrong_protocol_version(version: int) -> None:
    r = ReceiverProtocol(PEER)
    with pytest.raises(ProtocolError, match=f"protocol version {version}") as info:
        r.hello(hello(protocol=version))
    assert str(PROTOCOL_VERSION) in str(info.value)
    assert info.value.peer == PEER
    assert r.phase is Phase.HANDSHAKE


def test_second_hello_is_error() -> None:
    r = opened()
    with pytest.raises(ProtocolError, match="second hello"):
        r.hello(hello(session="other"))
    assert r.session == SESSION
    assert r.phase is Phase.IDLE


def test_second_hello_while_streaming_is_error() -> None:
    r = opened()
    apply(r, bucket(0, 1, [whole("a")]))
    with pytest.raises(ProtocolError, match="second hello"):
        r.hello(hello())
    assert r.phase is Phase.STREAMING


def test_bucket_before_hello() -> None:
    r = ReceiverProtocol(PEER)
    with pytest.raises(ProtocolError, match="before hello") as info:
        r.check_bucket(bucket(0, 1, [whole("a")]))
    assert info.value.peer == PEER
    assert info.value.version == 1
    assert r.phase is Phase.HANDSHAKE
    assert r.stream is None


def test_complete_before_hello() -> None:
    r = ReceiverProtocol(PEER)
    with pytest.raises(ProtocolError, match="before hello"):
        r.check_complete(Complete(0, 1, 0, 0))
    assert r.phase is Phase.HANDSHAKE


def test_abort_before_hello() -> None:
    r = ReceiverProtocol(PEER)
    with pytest.raises(ProtocolError, match="before hello"):
        r.abort(Abort("x"))
    assert r.phase is Phase.HANDSHAKE


def test_hello_after_rejected_message_still_works() -> None:
    r = ReceiverProtocol(PEER)
    with pytest.raises(ProtocolError):
        r.check_bucket(bucket(0, 1, [whole("a")]))
    r.hello(hello())
    apply(r, bucket(0, 1, [whole("a")]))


# --------------------------------------------------------------------------------------
# receiver: happy path
# --------------------------------------------------------------------------------------


def test_happy_path() -> None:
    r = opened(current_version=None)
    b0 = bucket(0, 1, [whole("a", 0), whole("b", 512, 100)])
    r.check_bucket(b0)
    assert r.phase is Phase.STREAMING
    assert r.stream is not None
    assert r.stream.version == 1
    assert r.bucket_applied(b0) == Ack(seq=0, ok=True)
    b1 = bucket(1, 1, [chunk("big", 0, BUF, 2 * BUF + 10)], buffer=1)
    assert apply(r, b1) == Ack(1, True)
    b2 = bucket(2, 1, [chunk("big", BUF, BUF, 2 * BUF + 10)], buffer=0)
    assert apply(r, b2) == Ack(2, True)
    b3 = bucket(3, 1, [chunk("big", 2 * BUF, 10, 2 * BUF + 10)], buffer=1)
    assert apply(r, b3) == Ack(3, True)
    assert r.stream.buckets == 4
    assert r.stream.tensors == 3
    assert r.stream.done == {"a", "b", "big"}
    assert r.stream.partial == {}
    done = Complete(4, 1, 4, 3)
    r.check_complete(done)
    assert r.phase is Phase.STREAMING  # checking does not commit
    assert r.current_version is None
    assert r.committed(done) == Ack(4, True)
    assert r.current_version == 1
    assert r.phase is Phase.IDLE
    assert r.stream is None


def test_consecutive_versions_share_the_sequence() -> None:
    r = opened(current_version=3)
    apply(r, bucket(0, 4, [whole("a")]))
    commit(r, Complete(1, 4, 1, 1))
    # same tensor names again in the next version; seq keeps counting
    apply(r, bucket(2, 5, [whole("a")]))
    commit(r, Complete(3, 5, 1, 1))
    assert r.current_version == 5
    assert r.next_seq == 4


def test_version_may_skip_ahead() -> None:
    r = opened(current_version=1)
    apply(r, bucket(0, 10, [whole("a")]))
    commit(r, Complete(1, 10, 1, 1))
    assert r.current_version == 10


def test_version_zero_from_scratch() -> None:
    r = opened(current_version=None)
    apply(r, bucket(0, 0, [whole("a")]))
    commit(r, Complete(1, 0, 1, 1))
    assert r.current_version == 0


def test_zero_byte_tensors_count() -> None:
    r = opened()
    empty = TensorSpec("e", "float32", (0, 3), 0, 0)
    apply(r, bucket(0, 1, [empty, whole("a", 0)]))
    assert r.stream is not None
    assert r.stream.tensors == 2
    commit(r, Complete(1, 1, 1, 2))


def test_bucket_with_no_specs_counts_as_bucket() -> None:
    r = opened()
    apply(r, Bucket(0, 1, 0, 0, []))
    commit(r, Complete(1, 1, 1, 0))
    assert r.current_version == 1


def test_bucket_may_fill_whole_buffer() -> None:
    r = opened()
    apply(r, Bucket(0, 1, 0, BUF, [TensorSpec("full", "uint8", (BUF,), 0, BUF)]))


def test_planned_buckets_are_accepted() -> None:
    import torch

    tensors = [(f"w{i}", torch.zeros(i * 37 + 1)) for i in range(30)]
    tensors.append(("huge", torch.zeros(3000)))
    r = opened()
    s = SenderProtocol(PEER)
    s.session = SESSION
    s.ready(Ready(SESSION, None))
    s.begin(1)
    n_buckets = 0
    for i, plan in enumerate(plan_buckets(tensors, BUF)):
        msg = Bucket(s.next_seq(), 1, i % 2, plan.used, plan.specs)
        wire_msg = decode(encode(msg))
        assert isinstance(wire_msg, Bucket)
        ack = apply(r, wire_msg)
        reply = decode(encode(ack))
        assert isinstance(reply, Ack)
        assert s.ack(reply) == msg.seq
        n_buckets += 1
    done = Complete(s.next_seq(), 1, n_buckets, len(tensors))
    ack = commit(r, done)
    assert s.ack(ack) == done.seq
    s.committed()
    assert s.remote_version == 1
    assert r.current_version == 1
    assert s.in_flight == 0


# --------------------------------------------------------------------------------------
# receiver: ordering and versions
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("seq", [1, 2, -1, 100])
def test_first_seq_must_be_zero(seq: int) -> None:
    r = opened()
    with pytest.raises(ProtocolError, match=f"sequence {seq} out of order \\(expected 0\\)"):
        r.check_bucket(bucket(seq, 1, [whole("a")]))


def test_repeated_seq_is_error() -> None:
    r = opened()
    apply(r, bucket(0, 1, [whole("a")]))
    with pytest.raises(ProtocolError, match="expected 1"):
        r.check_bucket(bucket(0, 1, [whole("b")]))


def test_skipped_seq_is_error() -> None:
    r = opened()
    apply(r, bucket(0, 1, [whole("a")]))
    with pytest.raises(ProtocolError, match="sequence 2"):
        r.check_bucket(bucket(2, 1, [whole("b")]))


def test_complete_with_wrong_seq_is_error() -> None:
    r = opened()
    apply(r, bucket(0, 1, [whole("a")]))
    with pytest.raises(ProtocolError, match="out of order"):
        r.check_complete(Complete(5, 1, 1, 1))


@pytest.mark.parametrize("version", [5, 4, 0])
def test_bucket_version_not_newer_than_current(version: int) -> None:
    r = opened(current_version=5)
    with pytest.raises(ProtocolError, match="not newer") as info:
        r.check_bucket(bucket(0, version, [whole("a")]))
    assert info.value.version == version
    assert r.phase is Phase.IDLE
    assert r.stream is None


def test_bucket_version_not_newer_after_commit() -> None:
    r = opened()
    apply(r, bucket(0, 2, [whole("a")]))
    commit(r, Complete(1, 2, 1, 1))
    with pytest.raises(ProtocolError, match="not newer"):
        r.check_bucket(bucket(2, 2, [whole("a")]))


@pytest.mark.parametrize("other", [2, 3, 0])
def test_bucket_of_other_version_while_streaming(other: int) -> None:
    r = opened(current_version=None)
    apply(r, bucket(0, 1, [whole("a")]))
    with pytest.raises(ProtocolError, match=f"version {other} while version 1 is open"):
        r.check_bucket(bucket(1, other, [whole("b")]))
    assert r.stream is not None
    assert r.stream.version == 1


@pytest.mark.parametrize("index", [-1, 2, 100])
def test_unknown_buffer_index(index: int) -> None:
    r = opened()
    with pytest.raises(ProtocolError, match=f"no buffer {index}"):
        r.check_bucket(bucket(0, 1, [whole("a")], buffer=index))


def test_bucket_larger_than_its_buffer() -> None:
    r = ReceiverProtocol(PEER)
    r.hello(hello(sizes=(BUF, 512)))
    apply(r, bucket(0, 1, [whole("a", 512)], buffer=0))  # fits the first buffer
    with pytest.raises(ProtocolError, match="bucket claims") as info:
        r.check_bucket(bucket(1, 1, [whole("b", 512)], buffer=1))
    assert info.value.peer == PEER
    assert info.value.version == 1


def test_bad_layout_names_tensor_peer_and_version() -> None:
    r = opened()
    bad = TensorSpec("layers.3.mlp", "float32", (4,), 100, 16)
    with pytest.raises(ProtocolError, match="misaligned") as info:
        r.check_bucket(Bucket(0, 1, 0, 1024, [whole("a"), bad]))
    err = info.value
    assert (err.peer, err.version, err.tensor) == (PEER, 1, "layers.3.mlp")
    for part in (PEER, "version 1", "'layers.3.mlp'"):
        assert part in str(err)


def test_unknown_dtype_in_bucket() -> None:
    r = opened()
    with pytest.raises(ProtocolError, match="dtype") as info:
        r.check_bucket(Bucket(0, 1, 0, 512, [TensorSpec("x", "float4", (4,), 0, 2)]))
    assert info.value.tensor == "x"


# --------------------------------------------------------------------------------------
# receiver: tensors and chunks
# --------------------------------------------------------------------------------------


def test_chunk_out_of_order_first() -> None:
    r = opened()
    with pytest.raises(ProtocolError, match="starts at byte 1024, expected 0") as info:
        r.check_bucket(bucket(0, 1, [chunk("big", 1024, 1024, 3000)]))
    assert info.value.tensor == "big"


def test_chunk_skipped() -> None:
    r = opened()
    apply(r, bucket(0, 1, [chunk("big", 0, 1024, 4000)]))
    with pytest.raises(ProtocolError, match="expected 1024") as info:
        r.check_bucket(bucket(1, 1, [chunk("big", 2048, 1024, 4000)]))
    assert info.value.tensor == "big"


def test_chunk_repeated() -> None:
    r = opened()
    apply(r, bucket(0, 1, [chunk("big", 0, 1024, 4000)]))
    with pytest.raises(ProtocolError, match="starts at byte 0, expected 1024"):
        r.check_bucket(bucket(1, 1, [chunk("big", 0, 1024, 4000)]))


def test_whole_tensor_while_its_chunks_are_partial() -> None:
    r = opened()
    apply(r, bucket(0, 1, [chunk("big", 0, 1024, 4000)]))
    with pytest.raises(ProtocolError, match="expected 1024"):
        r.check_bucket(bucket(1, 1, [TensorSpec("big", "uint8", (4000,), 0, 4000)]))


def test_chunks_interleaved_with_other_tensors() -> None:
    r = opened()
    apply(r, bucket(0, 1, [chunk("big", 0, 1024, 2000)]))
    apply(r, bucket(1, 1, [whole("a")]))
    apply(r, bucket(2, 1, [chunk("big", 1024, 976, 2000)]))
    assert r.stream is not None
    assert r.stream.done == {"a", "big"}
    commit(r, Complete(3, 1, 3, 2))


def test_chunk_progress_is_tracked() -> None:
    r = opened()
    apply(r, bucket(0, 1, [chunk("big", 0, 1024, 3000)]))
    assert r.stream is not None
    assert r.stream.received == {"big": 1024}
    assert r.stream.tensors == 0
    apply(r, bucket(1, 1, [chunk("big", 1024, 1024, 3000)]))
    assert r.stream.received == {"big": 2048}
    apply(r, bucket(2, 1, [chunk("big", 2048, 952, 3000)]))
    assert r.stream.partial == {}
    assert r.stream.tensors == 1


def test_tensor_sent_twice_across_buckets() -> None:
    r = opened()
    apply(r, bucket(0, 1, [whole("a")]))
    with pytest.raises(ProtocolError, match="'a' sent twice") as info:
        r.check_bucket(bucket(1, 1, [whole("a")]))
    assert info.value.version == 1


def test_chunked_tensor_sent_again_after_completion() -> None:
    r = opened()
    apply(r, bucket(0, 1, [chunk("big", 0, 1024, 1500)]))
    apply(r, bucket(1, 1, [chunk("big", 1024, 476, 1500)]))
    with pytest.raises(ProtocolError, match="sent twice"):
        r.check_bucket(bucket(2, 1, [chunk("big", 0, 1024, 1500)]))


def test_tensor_sent_twice_within_one_bucket() -> None:
    # BUG (protocol.py ReceiverProtocol.check_bucket): duplicates are only looked up in
    # ``progress.done``, which is updated by bucket_applied(), so one bucket naming the same
    # tensor twice passes the check, is applied twice and is counted as two tensors.
    r = opened()
    dup = Bucket(0, 1, 0, 1024, [whole("a", 0), whole("a", 512)])
    with pytest.raises(ProtocolError, match="'a' sent twice"):
        r.check_bucket(dup)


# --------------------------------------------------------------------------------------
# receiver: complete
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("buckets", "tensors"), [(1, 3), (3, 2), (0, 0), (2, 2), (2, 4)])
def test_complete_with_wrong_counts(buckets: int, tensors: int) -> None:
    r = opened()
    apply(r, bucket(0, 1, [whole("a", 0), whole("b", 512)]))
    apply(r, bucket(1, 1, [whole("c")]))
    with pytest.raises(ProtocolError, match="sender counted") as info:
        r.check_complete(Complete(2, 1, buckets, tensors))
    assert "2 / 3" in str(info.value)
    assert info.value.version == 1
    assert r.current_version is None


def test_complete_with_incomplete_chunked_tensor() -> None:
    r = opened()
    apply(r, bucket(0, 1, [whole("a")]))
    apply(r, bucket(1, 1, [chunk("big", 0, 1024, 3000)]))
    with pytest.raises(ProtocolError, match="incomplete") as info:
        r.check_complete(Complete(2, 1, 2, 1))
    assert info.value.tensor == "big"
    assert "'big'" in str(info.value)


def test_complete_for_never_streamed_version() -> None:
    r = opened()
    with pytest.raises(ProtocolError, match="never streamed"):
        r.check_complete(Complete(0, 1, 2, 3))


def test_complete_with_no_buckets_commits_an_empty_version() -> None:
    r = opened()
    r.check_complete(Complete(0, 1, 0, 0))
    assert r.committed(Complete(0, 1, 0, 0)).ok
    assert r.current_version == 1
    with pytest.raises(ProtocolError, match="not newer"):
        r.check_complete(Complete(1, 1, 0, 0))


def test_complete_for_other_version_than_streaming() -> None:
    r = opened()
    apply(r, bucket(0, 1, [whole("a")]))
    with pytest.raises(ProtocolError, match="never streamed") as info:
        r.check_complete(Complete(1, 2, 1, 1))
    assert info.value.version == 2


def test_complete_twice() -> None:
    r = opened()
    apply(r, bucket(0, 1, [whole("a")]))
    commit(r, Complete(1, 1, 1, 1))
    with pytest.raises(ProtocolError):
        r.check_complete(Complete(2, 1, 1, 1))
    assert r.current_version == 1


# --------------------------------------------------------------------------------------
# receiver: failure, abort, goodbye
# --------------------------------------------------------------------------------------


def failed_stream(version: int = 2, current: int | None = 1) -> ReceiverProtocol:
    r = opened(current_version=current)
    apply(r, bucket(0, version, [whole("a")]))
    r.check_bucket(bucket(1, version, [whole("b")]))
    r.fail()  # e.g. the sink could not apply bucket 1
    assert r.phase is Phase.FAILED
    return r


def test_failed_stream_refuses_its_buckets() -> None:
    r = failed_stream()
    with pytest.raises(RejectedError, match="already failed") as info:
        r.check_bucket(bucket(2, 2, [whole("c")]))
    assert not isinstance(info.value, ProtocolError)
    assert info.value.version == 2
    assert info.value.peer == PEER
    assert r.phase is Phase.FAILED
    # the refused bucket still consumed its sequence number: the next one goes on from 3
    with pytest.raises(RejectedError):
        r.check_bucket(bucket(3, 2, [whole("d")]))


def test_failed_stream_refuses_complete() -> None:
    r = failed_stream()
    with pytest.raises(RejectedError, match="failed"):
        r.check_complete(Complete(2, 2, 1, 1))
    assert r.current_version == 1


def test_failed_stream_accepts_new_version() -> None:
    r = failed_stream(version=2, current=1)
    apply(r, bucket(2, 3, [whole("a"), whole("b", 512)]))
    assert r.phase is Phase.STREAMING
    assert r.stream is not None
    assert r.stream.version == 3
    assert r.stream.buckets == 1  # progress starts afresh
    commit(r, Complete(3, 3, 1, 2))
    assert r.current_version == 3


def test_failed_stream_new_version_must_still_be_newer() -> None:
    r = failed_stream(version=2, current=1)
    with pytest.raises(ProtocolError, match="not newer"):
        r.check_bucket(bucket(2, 1, [whole("a")]))


def test_fail_without_stream_stays_idle() -> None:
    r = opened()
    r.fail()
    assert r.phase is Phase.IDLE
    apply(r, bucket(0, 1, [whole("a")]))


@pytest.mark.parametrize("failed", [False, True])
def test_abort_returns_to_idle(failed: bool) -> None:
    r = opened(current_version=1)
    apply(r, bucket(0, 2, [whole("a")]))
    if failed:
        r.fail()
    r.abort(Abort("trainer gave up", 2))
    assert r.phase is Phase.IDLE
    assert r.stream is None
    assert r.current_version == 1
    # the same version may be streamed again from scratch; "a" is not "sent twice"
    apply(r, bucket(1, 2, [whole("a")]))
    commit(r, Complete(2, 2, 1, 1))
    assert r.current_version == 2


def test_abort_while_idle() -> None:
    r = opened()
    r.abort(Abort("nothing to do"))
    assert r.phase is Phase.IDLE


def test_goodbye_closes() -> None:
    r = opened()
    apply(r, bucket(0, 1, [whole("a")]))
    r.goodbye(Goodbye(SESSION))
    assert r.phase is Phase.CLOSED
    assert r.stream is None
    assert r.current_version is None


def test_message_after_goodbye() -> None:
    r = opened()
    r.goodbye(Goodbye(SESSION))
    with pytest.raises(ProtocolError, match="after goodbye"):
        r.check_bucket(bucket(0, 1, [whole("a")]))
    with pytest.raises(ProtocolError, match="after goodbye"):
        r.check_complete(Complete(0, 1, 0, 0))
    with pytest.raises(ProtocolError, match="second hello"):
        r.hello(hello())
    r.abort(Abort("late"))
    assert r.phase is Phase.CLOSED


def test_goodbye_for_other_session() -> None:
    r = opened()
    with pytest.raises(ProtocolError, match="unknown session 'nope'"):
        r.goodbye(Goodbye("nope"))
    assert r.phase is Phase.IDLE


def test_goodbye_before_hello() -> None:
    r = ReceiverProtocol(PEER)
    with pytest.raises(ProtocolError):
        r.goodbye(Goodbye(SESSION))


def test_all_errors_are_aiosync_errors() -> None:
    assert issubclass(ProtocolError, AiosyncError)
    assert issubclass(RejectedError, AiosyncError)


# --------------------------------------------------------------------------------------
# sender
# --------------------------------------------------------------------------------------


def sender(remote: int | None = None) -> SenderProtocol:
    s = SenderProtocol(PEER)
    s.session = SESSION
    s.ready(Ready(SESSION, remote))
    return s


def test_sender_starts_in_handshake() -> None:
    s = SenderProtocol(PEER)
    assert s.phase is Phase.HANDSHAKE
    assert s.remote_version is None
    assert s.in_flight == 0


@pytest.mark.parametrize("remote", [None, 0, 12])
def test_ready_sets_remote_version(remote: int | None) -> None:
    s = sender(remote)
    assert s.phase is Phase.IDLE
    assert s.remote_version == remote


def test_ready_session_mismatch() -> None:
    s = SenderProtocol(PEER)
    s.session = SESSION
    with pytest.raises(ProtocolError, match="'other'") as info:
        s.ready(Ready("other", 3))
    assert info.value.peer == PEER
    assert s.phase is Phase.HANDSHAKE
    assert s.remote_version is None


def test_second_ready_is_error() -> None:
    s = sender(1)
    with pytest.raises(ProtocolError, match="unexpected ready"):
        s.ready(Ready(SESSION, 5))
    assert s.remote_version == 1


def test_begin_before_ready() -> None:
    s = SenderProtocol(PEER)
    with pytest.raises(ProtocolError, match="handshake"):
        s.begin(1)


@pytest.mark.parametrize("version", [5, 4, 0, -1])
def test_begin_with_old_version(version: int) -> None:
    s = sender(5)
    with pytest.raises(ProtocolError, match="not newer") as info:
        s.begin(version)
    assert info.value.version == version
    assert s.phase is Phase.IDLE


@pytest.mark.parametrize(("remote", "version"), [(None, 0), (None, 9), (5, 6), (5, 100)])
def test_begin_with_newer_version(remote: int | None, version: int) -> None:
    s = sender(remote)
    s.begin(version)
    assert s.phase is Phase.STREAMING
    assert s.version == version


def test_begin_while_streaming() -> None:
    s = sender()
    s.begin(1)
    with pytest.raises(ProtocolError, match="streaming"):
        s.begin(2)
    assert s.version == 1


def test_next_seq_counts_and_tracks_in_flight() -> None:
    s = sender()
    s.begin(1)
    assert [s.next_seq() for _ in range(4)] == [0, 1, 2, 3]
    assert s.in_flight == 4


def test_acks_in_order() -> None:
    s = sender()
    s.begin(1)
    seqs = [s.next_seq() for _ in range(3)]
    for i, seq in enumerate(seqs):
        assert s.ack(Ack(seq, True)) == seq
        assert s.in_flight == 2 - i


def test_negative_ack_is_still_matched() -> None:
    s = sender()
    s.begin(1)
    seq = s.next_seq()
    assert s.ack(Ack(seq, False, "bad shape", "w")) == seq
    assert s.in_flight == 0


def test_ack_out_of_order() -> None:
    s = sender()
    s.begin(1)
    s.next_seq()
    s.next_seq()
    with pytest.raises(ProtocolError, match="ack 1 out of order \\(expected 0\\)") as info:
        s.ack(Ack(1, True))
    assert info.value.version == 1
    assert s.in_flight == 2


def test_ack_repeated() -> None:
    s = sender()
    s.begin(1)
    s.next_seq()
    s.next_seq()
    s.ack(Ack(0, True))
    with pytest.raises(ProtocolError, match="out of order"):
        s.ack(Ack(0, True))


def test_ack_with_nothing_outstanding() -> None:
    s = sender()
    with pytest.raises(ProtocolError, match="nothing outstanding"):
        s.ack(Ack(0, True))
    s.begin(1)
    s.ack(Ack(s.next_seq(), True))
    with pytest.raises(ProtocolError, match="nothing outstanding"):
        s.ack(Ack(1, True))


def test_stale_acks_after_failed_are_ignored() -> None:
    s = sender(remote=3)
    s.begin(4)
    for _ in range(3):
        s.next_seq()
    s.ack(Ack(0, True))
    s.failed()
    assert s.phase is Phase.IDLE
    assert s.in_flight == 0
    assert s.remote_version == 3
    # leftovers of the failed stream, in any order
    assert s.ack(Ack(2, False, "boom")) is None
    assert s.ack(Ack(1, True)) is None
    assert s.ack(Ack(0, True)) is None
    # a new stream (the same version may be retried) goes on from seq 3
    s.begin(4)
    seq = s.next_seq()
    assert seq == 3
    assert s.ack(Ack(1, True)) is None
    assert s.ack(Ack(seq, True)) == seq


def test_ack_newer_than_anything_sent_after_failed() -> None:
    s = sender()
    s.begin(1)
    s.next_seq()
    s.failed()
    with pytest.raises(ProtocolError, match="nothing outstanding"):
        s.ack(Ack(5, True))


def test_failed_during_handshake_stays_in_handshake() -> None:
    s = SenderProtocol(PEER)
    s.failed()
    assert s.phase is Phase.HANDSHAKE


def test_committed_updates_remote_version() -> None:
    s = sender(remote=1)
    s.begin(2)
    seq = s.next_seq()
    s.ack(Ack(seq, True))
    done = s.next_seq()
    s.ack(Ack(done, True))
    s.committed()
    assert s.remote_version == 2
    assert s.phase is Phase.IDLE
    with pytest.raises(ProtocolError, match="not newer"):
        s.begin(2)
    s.begin(3)
    assert s.next_seq() == 2


def test_failed_keeps_remote_version() -> None:
    s = sender(remote=1)
    s.begin(2)
    s.failed()
    assert s.remote_version == 1
    s.begin(2)  # retry the same version
    assert s.phase is Phase.STREAMING


# --------------------------------------------------------------------------------------
# both ends together, through the codec
# --------------------------------------------------------------------------------------


def test_failed_stream_then_retry_end_to_end() -> None:
    r = ReceiverProtocol(PEER, current_version=None)
    s = SenderProtocol(PEER)
    s.session = SESSION
    ready = r.hello(decode(encode(hello())))  # type: ignore[arg-type]
    s.ready(decode(encode(ready)))  # type: ignore[arg-type]
    s.begin(1)
    # bucket 0 is applied, bucket 1 fails in the sink, bucket 2 was already in flight
    b0 = Bucket(s.next_seq(), 1, 0, 512, [whole("a")])
    b1 = Bucket(s.next_seq(), 1, 1, 512, [whole("b")])
    b2 = Bucket(s.next_seq(), 1, 0, 512, [whole("c")])
    acks = [apply(r, b0)]
    r.check_bucket(b1)
    r.fail()
    acks.append(Ack(b1.seq, False, "sink failed", "b"))
    with pytest.raises(RejectedError):
        r.check_bucket(b2)
    acks.append(Ack(b2.seq, False, "stream already failed"))
    assert s.ack(acks[0]) == 0
    assert s.ack(acks[1]) == 1  # the sender sees the refusal and gives up
    s.failed()
    r.abort(Abort("sink failed", 1))
    assert s.ack(acks[2]) is None  # the leftover ack of the failed stream
    # retry version 1 from scratch
    s.begin(1)
    for name in ("a", "b", "c"):
        msg = Bucket(s.next_seq(), 1, 0, 512, [whole(name)])
        assert s.ack(apply(r, msg)) == msg.seq
    done = Complete(s.next_seq(), 1, 3, 3)
    assert s.ack(commit(r, done)) == done.seq
    s.committed()
    assert r.current_version == s.remote_version == 1
    r.goodbye(Goodbye(SESSION))
    assert r.phase is Phase.CLOSED
