"""The data-plane interface: how a packed bucket's bytes reach an engine.

A sender's plane owns a ring of buffers. The pipeline packs a bucket into buffer ``i``
(:meth:`SenderPlane.pack`, blocking, in a worker thread), then :meth:`SenderPlane.publish`
makes those bytes visible to the engines (a no-op for memory they map, a broadcast for a
collective, a send for a network relay). The plane is described to engines once per
session (:attr:`SenderPlane.spec`, carried by the hello); an engine turns that description
into a :class:`ReceiverPlane` and reads each bucket with :meth:`ReceiverPlane.view`.

Both are abstract classes on which every hook the pipeline or the receiver calls is
declared, with a default that does what a plane without that step needs (nothing, for
most); a capability is a declared class attribute (:attr:`SenderPlane.joins_all`,
:attr:`ReceiverPlane.views_at_once`), never a name looked up. What one bucket's steps tell
the copies that follow them (the gates their streams wait on, one stream or a graph, a
device wait left to the commit) travels in a :class:`BucketContext` the caller makes for
that bucket and passes along.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from aiosync.core.errors import ProtocolError
from aiosync.core.layout import BucketPlan, TensorSpec
from aiosync.core.wire import PlaneSpec, Region

Part = tuple[torch.Tensor, list[TensorSpec]]
"""A bucket's bytes (a flat ``uint8`` view) and the specs that lie in them."""


class CounterGate:
    """A wait until another process's counter (a device word) reaches ``value``, as a gate.

    It never counts as fired: a batch behind one is never a graph
    (:mod:`aiosync.planes.cuda_copies`).
    """

    def __init__(self, address: int, value: int) -> None:
        self.address = address
        self.value = value

    def query(self) -> bool:
        """Whether the wait is known to be over: never, from the host."""
        return False


Gate = torch.cuda.Event | CounterGate
"""What a stream, and a batch's side streams before their fork, wait on: an event of
another process, or its counter reaching a value."""


@dataclass(slots=True)
class BucketContext:
    """One bucket's hints to the copies that follow, made by the caller for that bucket.

    The receiver makes one per applied bucket and hands it to the plane's hooks
    (:meth:`ReceiverPlane.parts`, :meth:`~ReceiverPlane.view`,
    :meth:`~ReceiverPlane.wait_after`) and to the sink
    (:meth:`aiosync.engine.sinks.WeightSink.apply_with`); a CUDA sender plane makes one per
    packed bucket. The next batch of copies queued with it
    (:meth:`aiosync.planes.cuda_copies.DeviceCopies.queue`) takes its hints:

    - ``gates``: other processes' events (or counters) the caller's stream was made to
      wait on; the batch's side streams wait on them too, before their fork;
    - ``one_stream``: the batch stays on the caller's stream (beside a collective);
    - ``graph``: the batch may run as a CUDA graph once it recurs (a direct bucket's reads);
    - ``deferred``: the plane orders this bucket's copies with events, so the sink leaves
      its device wait to the commit (read by sinks, not taken by a batch).
    """

    gates: list[Gate] = field(default_factory=list)
    one_stream: bool = False
    graph: bool = False
    deferred: bool = False

    def take(self) -> tuple[list[Gate], bool, bool]:
        """The hints for one batch (gates, one stream, graph), cleared for the next."""
        taken = (self.gates, self.one_stream, self.graph)
        if self.gates:
            self.gates = []
        self.one_stream = self.graph = False
        return taken


@dataclass
class DirectPlan(BucketPlan):
    """A bucket read in place: ``regions`` in order, buffer ``buffer`` (the direct index).

    What a direct plane (:mod:`aiosync.planes.direct`) packs nothing for; the pipeline
    names its regions in the bucket's message.
    """

    regions: list[Region] = field(default_factory=list)
    buffer: int = 0


@dataclass
class StoredPlan(BucketPlan):
    """A bucket whose bytes lie in buffer ``buffer`` already (a server's retained segment).

    What a plane that holds every bucket already (:attr:`SenderPlane.prepacked`) is sent:
    the pipeline packs nothing for it and names ``buffer`` in its message. ``digest``: the
    bucket's content (SHA-256), named in the message for an engine that keeps buckets;
    ``held``: that engine holds these bytes already, so it reads its own copy.
    """

    buffer: int = 0
    digest: bytes | None = None
    held: bool = False


def regions_of(plan: BucketPlan) -> list[Region]:
    """The trainer regions a plan is read from in place (empty: a packed plan)."""
    return plan.regions if isinstance(plan, DirectPlan) else []


class SenderPlane(ABC):
    """The trainer's side of a data plane: a ring of buffers to pack and publish.

    Besides the abstract members, hooks the pipeline calls on every plane, each a no-op
    here: :meth:`begin_version`, :meth:`queue`, :meth:`consumed`, :meth:`drain`,
    :meth:`arm` / :meth:`disarm` and :meth:`spec_for_link`; and :attr:`joins_all` and
    :attr:`prepacked`.
    """

    joins_all: bool = False
    """Every engine takes part in every send, even one it refused (a collective plane):
    the pipeline keeps sending a refusing engine the version's buckets (it joins and drops
    them), counts its refusal instead of ending its stream, never sends a ``begin`` before
    the read, and sends the ``commit`` only after :meth:`drain`."""

    prepacked: bool = False
    """Every bucket's bytes lie in the plane's buffers already (a server's retained
    segments): each plan is a :class:`StoredPlan` from a list, :meth:`pack` copies
    nothing, and :attr:`count` only bounds the buckets in flight. The pipeline then takes
    and encodes a bucket of bounded size on the event loop, with no hop to a worker."""

    @property
    @abstractmethod
    def spec(self) -> PlaneSpec:
        """Plain data from which an engine opens this plane (sent in the hello)."""

    @property
    @abstractmethod
    def capacity(self) -> int:
        """Bytes of each buffer (a multiple of the layout's alignment)."""

    @property
    @abstractmethod
    def count(self) -> int:
        """Number of buffers in the ring (the most buckets in flight)."""

    @abstractmethod
    def pack(self, index: int, plan: BucketPlan) -> None:
        """Copy ``plan``'s tensors into buffer ``index`` and wait until the bytes are there.

        Blocking; the pipeline calls it from a worker thread.
        """

    @abstractmethod
    async def publish(self, index: int, used: int) -> None:
        """Make the first ``used`` bytes of buffer ``index`` visible to every engine."""

    @abstractmethod
    def close(self) -> None:
        """Release the buffers (idempotent)."""

    def begin_version(self) -> None:
        """On the caller's thread, before a version's first pack (a CUDA plane takes its stream)."""
        return None

    def queue(self, index: int) -> None:
        """Queue the send of the bucket packed in ``index`` (in the packing thread).

        Called after :meth:`pack` once nothing stands between the bucket and its
        publishing (its message encoded, the engines' answers to the begin in); a
        collective plane queues its broadcast here, and :meth:`publish` does what this
        was not called for.
        """
        return None

    def consumed(self, index: int, events: list[bytes]) -> None:
        """An engine acked buffer ``index``; ``events``: its reads' IPC events (CUDA)."""
        return None

    async def drain(self) -> None:
        """After the last bucket, before the trainer's tensors are free: sends still reading."""
        return None

    def spec_for_link(self) -> tuple[PlaneSpec, int | None]:
        """The spec for one more engine session, and its counter word (None: no counter)."""
        return self.spec, None

    def arm(self, index: int, words: Sequence[int]) -> int | None:
        """The counter value a bucket sent ahead of its packing into ``index`` names.

        None: this plane cannot send a bucket ahead of its packing (no counters). A plane
        that can sets each engine's word in ``words`` to the value at the buffer's next
        :meth:`pack` (or at :meth:`disarm`).
        """
        return None

    def disarm(self) -> None:
        """Release what :meth:`arm` promised if no pack comes (the read failed)."""
        return None


class ReceiverPlane(ABC):
    """The engine's side of a data plane.

    Besides :meth:`view` and :meth:`close`, hooks the receiver calls on every plane, each
    with a default for a plane that needs no such step: :meth:`parts`, :meth:`expect`,
    :meth:`wait_after`, :meth:`applied`, :meth:`skip` and :meth:`settle`; and the
    capabilities :attr:`views_at_once`, :attr:`joins_all` and :attr:`events`.
    """

    views_at_once: bool = False
    """A view never waits on the host, so a bucket may be applied on the receiver's event
    loop (:mod:`aiosync.engine.quick_apply`): shared memory, CUDA planes ordered by events,
    direct mode. Not a collective plane, whose view joins a broadcast."""

    joins_all: bool = False
    """One rank of a collective group: it joins every broadcast, so a bucket the engine
    refused still goes through :meth:`skip`, and :meth:`settle` runs (in a worker thread)
    before a version is called whole."""

    events: Sequence[bytes] = ()
    """The engine's IPC events, sent to the trainer in the ready: non-empty when the plane
    orders a bucket's copies with events (its :meth:`applied` records them), so sinks
    leave their device wait to the commit (:attr:`BucketContext.deferred`)."""

    @abstractmethod
    def view(self, index: int, used: int, context: BucketContext | None = None) -> torch.Tensor:
        """The first ``used`` bytes of buffer ``index`` as flat ``uint8`` (valid until acked).

        A wait queued on this thread's stream (another process's event) is noted in
        ``context`` for the copies that follow.
        """

    @abstractmethod
    def close(self) -> None:
        """Release this engine's hold on the buffers (idempotent)."""

    def expect(self, index: int, specs: list[TensorSpec]) -> None:
        """The (checked) specs of the bucket about to be viewed in ``index``.

        For a plane that needs them before :meth:`view` (a per-tensor collective plane
        receives each tensor into its slot; a gathered plane picks the part).
        """
        return None

    def parts(
        self,
        index: int,
        used: int,
        specs: list[TensorSpec],
        regions: list[Region],
        version: int,
        context: BucketContext | None = None,
    ) -> list[Part]:
        """An applied bucket as (flat bytes, specs) pairs for the sink: one, or one per region.

        Here: :meth:`expect`, then :meth:`view`; a bucket naming ``regions`` (trainer
        memory) is a :class:`ProtocolError`: only a direct plane reads them.
        """
        if regions:
            raise ProtocolError(
                "a bucket names trainer memory, but the session is not in direct mode"
            )
        self.expect(index, specs)
        return [(self.view(index, used, context), specs)]

    def wait_after(self, value: int, context: BucketContext | None = None) -> None:
        """Make this thread's stream wait until the trainer's counter reaches ``value``.

        For a bucket sent ahead of its packing; a plane with no counter refuses it.
        """
        raise ProtocolError("a bucket sent ahead of its packing, but the plane has no counter")

    def applied(self, index: int) -> None:
        """The bucket's copies out of buffer ``index`` are queued on this thread's stream."""
        return None

    def skip(self, index: int, used: int, slots: list[tuple[int, int]]) -> None:
        """Join the send of a bucket this engine refused, and drop it (:attr:`joins_all`)."""
        return None

    def settle(self) -> None:
        """Block until every receive queued so far is done (:attr:`joins_all`); may raise."""
        return None
