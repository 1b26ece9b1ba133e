"""The argument plumbing shared by handles that call an engine's methods by name.

A :class:`CallingHandle` turns each :class:`EngineHandle` method into one call of the
engine's method of the same name with keyword arguments of plain data (lists, str, int,
bool, bytes; unset optional ones left out), and reads the answer with
:func:`aiosync.handles.results.as_result`. Subclasses say how one call is made.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from aiosync.handles.base import EngineHandle, HealthStatus, WeightSyncResult
from aiosync.handles.results import MAX_TEXT, as_result


def call_kwargs(**kwargs: object) -> dict[str, object]:
    """The keyword arguments to pass on: those set to None are left out.

    Engines differ in which optional arguments they know (``weight_version``,
    ``load_format``, aiosync's ``token``); an unset one is not passed at all.
    """
    return {key: value for key, value in kwargs.items() if value is not None}


def health_of(reply: object) -> HealthStatus:
    """An engine's ``check_health`` answer (None, bool, dict, tuple or object) as plain data."""
    if isinstance(reply, HealthStatus):
        return reply
    if reply is None or isinstance(reply, bool):
        return HealthStatus(healthy=reply is not False)
    if isinstance(reply, dict):
        healthy = reply.get("healthy", reply.get("success", True)) is not False
        version = reply.get("weight_version")
        text = reply.get("message") or reply.get("error") or ""
        return HealthStatus(
            healthy=healthy,
            message=str(text)[:MAX_TEXT],
            weight_version=None if version is None else str(version),
        )
    result = as_result(reply)
    return HealthStatus(healthy=result.success, message=result.message)


class CallingHandle(EngineHandle):
    """An :class:`EngineHandle` whose methods each call the engine's method of that name."""

    @abc.abstractmethod
    async def call(self, method: str, kwargs: dict[str, object]) -> WeightSyncResult:
        """Call ``method(**kwargs)`` on the engine and read its answer.

        A failed result when the engine answered with a failure or raised; an
        :class:`~aiosync.core.errors.AiosyncError` when it could not be reached.
        """

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
        """Call the engine's ``init_weights_update_group`` (``token`` only when set)."""
        kwargs = call_kwargs(
            master_address=master_address,
            master_port=int(master_port),
            rank_offset=int(rank_offset),
            world_size=int(world_size),
            group_name=group_name,
            backend=backend,
            token=token,
        )
        return await self.call("init_weights_update_group", kwargs)

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
        """Call the engine's ``update_weights_from_distributed`` with plain lists."""
        kwargs = call_kwargs(
            names=list(names),
            dtypes=list(dtypes),
            shapes=[[int(dim) for dim in shape] for shape in shapes],
            group_name=group_name,
            flush_cache=flush_cache,
            load_format=load_format,
            weight_version=weight_version,
        )
        return await self.call("update_weights_from_distributed", kwargs)

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: Sequence[bytes | str],
        load_format: str | None = None,
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> WeightSyncResult:
        """Call the engine's ``update_weights_from_tensor`` with the opaque entries."""
        kwargs = call_kwargs(
            serialized_named_tensors=list(serialized_named_tensors),
            load_format=load_format,
            flush_cache=flush_cache,
            weight_version=weight_version,
        )
        return await self.call("update_weights_from_tensor", kwargs)

    async def destroy_weights_update_group(self, group_name: str) -> WeightSyncResult:
        """Call the engine's ``destroy_weights_update_group``."""
        return await self.call("destroy_weights_update_group", {"group_name": group_name})
