"""One protocol (issue 27, item 2): both ends speak :data:`~aiosync.core.wire.PROTOCOL` only.

The hello still states a range, so a peer of another build is refused once, by an error
that names both sides' versions: on the engine (an ``abort`` to the sender) and on the
sender (a ready naming another protocol, or the engine's refusal). What older protocols
needed negotiating (a bucket inside the ``begin``, a bucket sent ahead of its packing) is
simply part of the one protocol, and the collective plane's ``overlap`` field is gone.
"""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
import torch

from aiosync import ModuleSink, PeerGoneError, SenderConfig, WeightReceiver, WeightSender
from aiosync.core import trainer_session
from aiosync.core.engine_actions import Apply, OpenPlane
from aiosync.core.errors import ProtocolError
from aiosync.core.trainer_session import LinkSession
from aiosync.core.wire import (
    PROTOCOL,
    Abort,
    Ack,
    Begin,
    CollectivePlaneSpec,
    Ready,
    Slot,
    spoken,
)
from aiosync.planes.collective import CollectiveOptions
from tests.unit.test_engine_session import (
    MANIFEST,
    PEER,
    SESSION,
    applies,
    by_slots,
    hello,
    machine,
    model,
    replies,
    send,
)

only_asyncio = pytest.mark.asyncio(loop_factories=["asyncio"])


def test_a_range_is_put_in_words() -> None:
    assert spoken(5, 5) == "protocol 5"
    assert spoken(2, 4) == "protocols 2-4"


@pytest.mark.parametrize(("low", "high"), [(2, 4), (PROTOCOL + 1, PROTOCOL + 1)])
def test_an_engine_refuses_a_sender_of_another_build_naming_both(low: int, high: int) -> None:
    engine = machine()
    actions = engine.receive(PEER, hello(low=low, high=high), 0.0)
    (abort,) = replies(actions)
    assert isinstance(abort, Abort)
    assert abort.reason == (
        f"session refused: the sender speaks {spoken(low, high)}, this engine protocol "
        f"{PROTOCOL} (run the same aiosync release on both ends)"
    )
    assert not any(isinstance(a, OpenPlane) for a in actions)
    assert engine.sessions == {}
    assert engine.protocol_errors == 1


@pytest.mark.parametrize("chosen", [2, 3, 4, PROTOCOL + 1])
def test_a_sender_refuses_an_engine_that_chose_another_protocol_naming_both(chosen: int) -> None:
    link = LinkSession("engine-0", SESSION)
    hello_message = link.hello("trainer", hello().plane)
    assert (hello_message.protocol_min, hello_message.protocol_max) == (PROTOCOL, PROTOCOL)
    with pytest.raises(ProtocolError) as info:
        link.ready(Ready(SESSION, chosen, None))
    assert str(info.value) == (
        f"the engine chose protocol {chosen}, this sender speaks protocol {PROTOCOL} "
        "(run the same aiosync release on both ends) [peer engine-0]"
    )
    assert link.protocol is None


def test_the_previous_builds_range_meets_this_one_on_the_one_protocol() -> None:
    engine = machine(model())
    ready = replies(send(engine, hello(low=2, high=PROTOCOL)))
    assert ready == [Ready(SESSION, PROTOCOL, None)]
    first = by_slots(0, 1, [Slot(0, 0, 16)])
    actions = send(engine, Begin(0, MANIFEST, first=first))  # no protocol to check first
    assert [(a.seq, a.ok) for a in replies(actions) if isinstance(a, Ack)] == [(0, True), (1, True)]
    ahead = msgspec.structs.replace(by_slots(0, 2, [Slot(1, 0, 16)], buffer=1), after=1)
    (apply,) = applies(engine.receive(PEER, ahead, 0.0))
    assert isinstance(apply, Apply)
    assert apply.after == 1
    assert engine.protocol_errors == 0


@only_asyncio
async def test_a_sender_of_another_build_hears_the_engines_refusal_naming_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(trainer_session, "PROTOCOL", PROTOCOL + 1)  # a newer trainer build
    config = SenderConfig(buffer_bytes=64 * 1024, timeout=10)
    async with WeightReceiver(ModuleSink({"w": torch.zeros(4)})) as receiver:
        with pytest.raises(PeerGoneError) as info:
            async with WeightSender([receiver.endpoint], config=config) as sender:
                await sender.send({"w": torch.ones(4)}, version=0)
        message = str(info.value)
        assert receiver.endpoint in message
        assert f"the sender speaks protocol {PROTOCOL + 1}, this engine protocol {PROTOCOL}" in (
            message
        )
        assert receiver.protocol_errors == 1
        assert receiver.sessions == 0
        assert receiver.current_version is None


def test_the_collective_plane_spec_has_no_overlap_field() -> None:
    assert "overlap" not in CollectivePlaneSpec.__struct_fields__


def test_collective_overlap_is_deprecated_and_changes_nothing() -> None:
    with pytest.warns(DeprecationWarning, match=r"overlap=\.\.\.\) is deprecated") as caught:
        options = CollectiveOptions(engines=2, overlap=True)
    assert caught[0].filename == __file__  # the warning names the caller's line
    assert options == CollectiveOptions(engines=2)
    assert "overlap" not in {f.name for f in dataclasses.fields(CollectiveOptions)}
