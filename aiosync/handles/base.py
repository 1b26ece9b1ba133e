"""The one async interface through which aiosync drives a rollout engine's weight updates.

:class:`EngineHandle` mirrors the weight-update methods of an SGLang engine
(``init_weights_update_group``, ``update_weights_from_distributed``,
``update_weights_from_tensor``, ``destroy_weights_update_group``) plus ``check_health``,
with the same argument names, and answers with plain data (:class:`WeightSyncResult`,
:class:`HealthStatus`) whatever the engine itself returns. Adapters exist for an engine
object in this process, a Ray actor and an engine process behind aiosync's control channel;
:func:`aiosync.handles.as_engine_handle` picks one for whatever a caller holds.

A handle on an engine in another process bounds each call by its own ``timeout`` (default
:data:`CALL_TIMEOUT`): an engine that does not answer by then is a
:class:`~aiosync.core.errors.SyncTimeoutError` naming it. Callers may also put one deadline
around a whole sync (``anyio.fail_after``); a handle's calls are cancellable at any await.
An :class:`~aiosync.handles.ObjectHandle` has no timeout of its own: its calls run the
engine's code in this process, which a timeout could abandon but not stop.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from types import TracebackType

import msgspec

from aiosync.core.answers import WeightSyncResult as WeightSyncResult

CALL_TIMEOUT = 120.0
"""Seconds a handle on an engine in another process waits for one call's answer, by default.

The same as the compat functions' ``AIOSYNC_TIMEOUT`` default; keep a handle's timeout above
the longest call it makes (a group join waits for every member, an update for its bucket).
"""


class HealthStatus(msgspec.Struct, frozen=True):
    """What an engine said about itself in answer to :meth:`EngineHandle.check_health`."""

    healthy: bool
    """True when the engine answered and reports itself able to serve."""
    message: str = ""
    """The engine's text (or why it could not be reached)."""
    weight_version: str | None = None
    """The weight version the engine serves now, when it says."""


class EngineHandle(abc.ABC):
    """An async handle on one rollout engine (which may span several GPUs/ranks).

    Methods take the arguments SGLang's engine methods take, by the same names, and return
    plain data. A method returns a result with ``success=False`` when the engine answered
    that it failed; it raises an :class:`~aiosync.core.errors.AiosyncError` when the engine
    could not be reached or answered something malformed. Use as ``async with handle:`` or
    call :meth:`aclose` when done; closing does not stop the engine.
    """

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """A short name for the engine, used in every error and log line about it."""

    @abc.abstractmethod
    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
        *,
        token: str | None = None,
    ) -> WeightSyncResult:
        """Join the weight-update process group at ``master_address:master_port``.

        The engine's ranks take ``rank_offset``, ``rank_offset + 1``, ... of ``world_size``.
        ``token`` (an aiosync extension, left out of the call when None) is the random part
        of the group's rendezvous key prefix, handed over the authenticated channel. The
        call returns once the engine has joined (the rendezvous completes when every member,
        the trainer included, joins), so callers run it concurrently with their own join.
        """

    @abc.abstractmethod
    async def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        load_format: str | None = None,
        weight_version: str | None = None,
    ) -> WeightSyncResult:
        """Receive one bucket broadcast by group rank 0 into the named weights.

        ``dtypes`` are torch dtype names (``"bfloat16"`` or ``"torch.bfloat16"``). With
        ``load_format=None`` rank 0 broadcasts each tensor in order; the call returns after
        the engine has received and applied all of them (so callers issue it first, then
        broadcast, then await it).
        """

    @abc.abstractmethod
    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[bytes | str],
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> WeightSyncResult:
        """Apply tensors handed over in serialized form, one entry per engine rank.

        The entries are opaque bytes (or str) to the handle and the transport: only the
        engine decodes them, so no transport ever unpickles tensors for aiosync.
        """

    @abc.abstractmethod
    async def destroy_weights_update_group(self, group_name: str) -> WeightSyncResult:
        """Leave and destroy the weight-update group ``group_name`` on the engine side."""

    @abc.abstractmethod
    async def check_health(self) -> HealthStatus:
        """Ask the engine whether it is alive and serving; never raises for a bad answer."""

    async def aclose(self) -> None:
        """Release what the handle holds (channels, threads); the engine keeps running."""
        return None

    async def __aenter__(self) -> EngineHandle:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
