"""Planes and sinks as declared interfaces (issue 27, item 4).

Every hook the pipeline or the receiver calls on a plane or a sink is declared on its
abstract base class with a default; none is looked up by name, and what one bucket's steps
tell the copies after them travels in a :class:`~aiosync.planes.base.BucketContext` the
caller passes along (no thread-local hints). A sink that does not subclass
:class:`~aiosync.WeightSink` is adapted once, when the receiver is made.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import aiosync.planes
import aiosync.topology
from aiosync import ModuleSink, SenderConfig, WeightReceiver, WeightSender, WeightSink
from aiosync.core.engine_actions import Apply
from aiosync.core.errors import ProtocolError, UsageError
from aiosync.core.layout import BucketPlan, TensorSpec
from aiosync.core.wire import ShmHandle, ShmPlaneSpec
from aiosync.engine.sink_shape import ReservingSinkAdapter, SinkAdapter, as_weight_sink
from aiosync.engine.sinks import CallbackSink, apply_parts
from aiosync.planes import view_parts
from aiosync.planes.base import BucketContext, Part, ReceiverPlane, SenderPlane
from aiosync.planes.shm import ShmReceiverPlane
from benchmarks.shape import PACKAGE, shape

SINK_OR_PLANE = re.compile(r"getattr\(\s*(self\.)?_?(plane|sink)|hasattr\(.*(plane|sink)")


def test_no_capability_is_looked_up_by_name_on_planes_and_sinks() -> None:
    assert shape()["capability_lookups"] == 0  # getattr(plane|sink, ...), attr-defined
    found = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if SINK_OR_PLANE.search(line)
    ]
    assert found == []


def test_no_thread_local_state_in_the_package() -> None:
    users = [p.name for p in PACKAGE.rglob("*.py") if "threading.local" in p.read_text()]
    assert users == []


def concrete_planes() -> list[type]:
    """Every class of ``aiosync/planes`` and ``aiosync/topology`` that is a plane's side."""
    found: list[type] = []
    for package in (aiosync.planes, aiosync.topology):
        for info in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            for cls in vars(module).values():
                if inspect.isclass(cls) and cls.__module__ == module.__name__:
                    found.append(cls)
    return found


def hooks(base: type) -> list[str]:
    return [name for name in vars(base) if not name.startswith("_")]


@pytest.mark.parametrize("base", [SenderPlane, ReceiverPlane])
def test_every_plane_implements_or_inherits_every_declared_hook(base: type) -> None:
    planes = [cls for cls in concrete_planes() if issubclass(cls, base) and cls is not base]
    assert len(planes) >= 4
    for cls in planes:
        assert not inspect.isabstract(cls), cls
        for name in hooks(base):
            declared, own = inspect.getattr_static(base, name), inspect.getattr_static(cls, name)
            if callable(declared) and not isinstance(declared, type):
                wanted = list(inspect.signature(declared).parameters)
                got = inspect.signature(own).parameters
                assert list(got)[: len(wanted)] == wanted, (cls, name)
                extra = list(got.values())[len(wanted) :]
                assert all(p.default is not p.empty for p in extra), (cls, name)
            elif isinstance(declared, property):
                assert isinstance(own, property), (cls, name)


def test_every_class_shaped_as_a_plane_subclasses_its_base() -> None:
    """A class that publishes is a sender plane; one that views a buffer is a receiver's."""
    for cls in concrete_planes():
        if "publish" in vars(cls):
            assert issubclass(cls, SenderPlane), cls
        view = vars(cls).get("view")
        if view is not None and list(inspect.signature(view).parameters)[1:3] == [
            "index",
            "used",
        ]:
            assert issubclass(cls, ReceiverPlane), cls


class OnlyView(ReceiverPlane):
    """A receiver plane with nothing but the abstract members."""

    def view(self, index: int, used: int, context: BucketContext | None = None) -> torch.Tensor:
        return torch.arange(used, dtype=torch.uint8)

    def close(self) -> None:
        pass


class OnlyPack(SenderPlane):
    """A sender plane with nothing but the abstract members."""

    spec = ShmPlaneSpec([ShmHandle("x", 64)])
    capacity = 64
    count = 1

    def pack(self, index: int, plan: BucketPlan) -> None:
        pass

    async def publish(self, index: int, used: int) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_plane_with_only_its_abstract_members_gets_the_defaults() -> None:
    specs = [TensorSpec("w", "uint8", (4,), 0, 4)]
    plane = OnlyView()
    [(data, got)] = view_parts(plane, Apply(None, 1, 1, 0, 4, specs))  # type: ignore[arg-type]
    assert data.tolist() == [0, 1, 2, 3]
    assert got is specs
    with pytest.raises(ProtocolError, match="not in direct mode"):
        plane.parts(0, 4, specs, [ShmHandle("r", 4)], 1)
    with pytest.raises(ProtocolError, match="no counter"):
        plane.wait_after(1)
    assert (plane.views_at_once, plane.joins_all, plane.events) == (False, False, ())
    sender = OnlyPack()
    assert sender.spec_for_link() == (sender.spec, None)
    assert sender.arm(0, [0]) is None
    assert sender.joins_all is False
    sender.begin_version(), sender.queue(0), sender.consumed(0, []), sender.disarm()


class Duck:
    """A sink of WeightSink's shape that does not subclass it (as sinks were written)."""

    def __init__(self) -> None:
        self.calls: list[Any] = []
        self.device = torch.device("cpu")
        self.staged = False

    def expectations(self) -> None:
        return None

    def apply_bucket(self, bucket: torch.Tensor, specs: list[TensorSpec]) -> None:
        self.calls.append(("bucket", len(specs)))

    def commit(self, version: int) -> None:
        self.calls.append(("commit", version))

    def abort(self) -> None:
        self.calls.append(("abort",))


class Hooked(Duck):
    """A duck-typed sink with hooks of its own."""

    part_devices = [torch.device("cpu")] * 2

    def reserve(self) -> None:
        self.calls.append(("reserve",))

    def commit_quickly(self, version: int) -> bool:
        self.calls.append(("quickly", version))
        return True

    def applies_quickly(self) -> bool:
        return True

    def apply_parts(self, parts: list[Part]) -> None:
        self.calls.append(("parts", len(parts)))


def parts(n: int) -> list[Part]:
    tensor = torch.zeros(4, dtype=torch.uint8)
    return [(tensor, [TensorSpec(f"t{i}", "uint8", (4,), 0, 4)]) for i in range(n)]


def test_a_duck_typed_sink_is_adapted_with_the_defaults_it_lacks() -> None:
    duck = Duck()
    sink = as_weight_sink(duck)
    assert type(sink) is SinkAdapter
    assert sink.wrapped is duck
    sink.reserve()
    assert not sink.commit_quickly(1)
    assert not sink.applies_quickly()
    assert sink.part_devices is None
    sink.apply_with(parts(3), BucketContext())  # one apply_bucket a part
    sink.commit(2)
    sink.abort()
    assert duck.calls == [("bucket", 1)] * 3 + [("commit", 2), ("abort",)]
    module = ModuleSink({"w": torch.zeros(1)})
    assert as_weight_sink(module) is module  # a subclass as it is


def test_a_duck_typed_sinks_own_hooks_are_called() -> None:
    duck = Hooked()
    sink = as_weight_sink(duck)
    assert isinstance(sink, ReservingSinkAdapter)
    sink.reserve()
    assert sink.commit_quickly(3)
    assert sink.applies_quickly()
    assert list(sink.part_devices or []) == duck.part_devices
    sink.apply_with(parts(2), BucketContext())
    assert duck.calls == [("reserve",), ("quickly", 3), ("parts", 2)]


def test_a_sink_lacking_a_member_is_refused_naming_it() -> None:
    class Old:
        device = torch.device("cpu")

        def apply_bucket(self, bucket: torch.Tensor, specs: list[TensorSpec]) -> None:
            pass

    with pytest.raises(UsageError, match=r"no staged, expectations\(\), commit\(\), abort\(\)"):
        as_weight_sink(Old())  # type: ignore[arg-type]


class Minimal(WeightSink):
    """A user's sink subclassing WeightSink with its six abstract members only."""

    def __init__(self) -> None:
        self.buckets = 0

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def staged(self) -> bool:
        return False

    def expectations(self) -> None:
        return None

    def apply_bucket(self, bucket: torch.Tensor, specs: list[TensorSpec]) -> None:
        self.buckets += 1

    def commit(self, version: int) -> None:
        pass

    def abort(self) -> None:
        pass


def test_a_subclass_inherits_every_hook_with_its_default() -> None:
    sink = Minimal()
    sink.reserve()
    assert (sink.commit_quickly(0), sink.applies_quickly(), sink.part_devices) == (
        False,
        False,
        None,
    )
    sink.apply_with(parts(2), BucketContext())
    apply_parts(sink, parts(3))
    assert sink.buckets == 5
    with pytest.raises(TypeError, match="abstract"):
        type("Half", (WeightSink,), {})()


def test_a_callback_sink_defers_its_device_wait_only_under_a_deferred_context(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from aiosync.engine import callback_sink

    waits: list[Any] = []
    monkeypatch.setattr(callback_sink, "sync_cuda", lambda devices, context: waits.append(context))
    sink = CallbackSink(lambda pairs: list(pairs))
    context = BucketContext(deferred=True)
    sink.apply_with(parts(1), context)
    sink.apply_bucket(*parts(1)[0])  # called on its own: no context
    assert waits == [context, None]


async def test_each_bucket_has_its_own_context_from_the_plane_to_the_sink(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The receiver makes one context per bucket; the plane's view and the sink get it."""
    viewed: list[BucketContext | None] = []
    applied: list[BucketContext] = []
    view = ShmReceiverPlane.view

    def recording(
        self: ShmReceiverPlane, index: int, used: int, context: BucketContext | None = None
    ) -> torch.Tensor:
        viewed.append(context)
        return view(self, index, used, context)

    class Recording(ModuleSink):
        def apply_with(self, parts: list[Part], context: BucketContext) -> None:
            applied.append(context)
            super().apply_with(parts, context)

    monkeypatch.setattr(ShmReceiverPlane, "view", recording)
    weights = {f"w{i}": torch.full((1024,), float(i)) for i in range(6)}  # two a bucket
    model = {name: torch.zeros_like(t) for name, t in weights.items()}
    config = SenderConfig(buffer_bytes=8192, num_buffers=2)
    async with (
        WeightReceiver(Recording(model)) as receiver,
        WeightSender(receiver.endpoint, config=config) as sender,
    ):
        await sender.send(weights, version=0)
    assert all(torch.equal(model[n], t) for n, t in weights.items())
    assert len(applied) == 3
    assert viewed == applied  # the very objects, bucket by bucket
    assert len({id(context) for context in applied}) == 3
    assert not any(context.deferred for context in applied)  # shared memory: no events


def test_the_shape_counts_a_lookup_it_should() -> None:
    """The figure the first test reads is not zero by construction."""
    from benchmarks import shape as shape_module

    text = 'x = getattr(plane, "queue", None)\ny = getattr(self.sink, "reserve", None)\n'
    assert len(shape_module.LOOKUP.findall(text)) == 2
    assert SINK_OR_PLANE.search('hasattr(self._plane, "arm")')
    assert Path(shape_module.__file__).parent.name == "benchmarks"
