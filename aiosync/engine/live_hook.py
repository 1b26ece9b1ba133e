"""The ``on_live`` hook: what an engine runs the moment a version goes live.

An engine that keeps anything computed from its weights (a prefix or KV cache) must drop
it when new weights go live, before any request reads them. The receiver's swap
(:mod:`aiosync.engine.commit`) calls the hook once the sink made the new weights live,
while it still holds the lease gate: the version becomes ``current_version`` as the hook
returns, no read lease on it is granted before, and a lease asked for meanwhile waits.
With ``ReceiverConfig(ack_at="live")`` the sender's acknowledgement waits for it too.

A plain function runs in a worker thread; an ``async def`` (or an object whose
``__call__`` is one) is awaited on the event loop. Either is waited for at most
``ReceiverConfig.swap_timeout`` seconds; a thread still running then is left to finish
(threads are not interrupted), and the version counts as live with a failed hook.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from aiosync.core.errors import AiosyncError, SyncTimeoutError

OnLive = Callable[[int], object]
"""``on_live(version)``: a function, or an ``async def``, of the version now live."""


def is_async(hook: OnLive) -> bool:
    """Whether ``hook`` is awaited on the loop (an ``async def``) rather than run in a thread."""
    call = type(hook).__call__  # an object whose __call__ is an async def
    return inspect.iscoroutinefunction(hook) or inspect.iscoroutinefunction(call)


def _in_thread(hook: OnLive, version: int) -> None:
    result = hook(version)
    if inspect.isawaitable(result):
        if inspect.iscoroutine(result):
            result.close()  # never awaited: no "coroutine was never awaited" warning
        raise TypeError(
            "it returned an awaitable from a worker thread; make on_live an async def "
            "so that the receiver awaits it on its loop"
        )


async def call_on_live(hook: OnLive, version: int, timeout: float) -> None:
    """Run ``hook(version)`` and wait for it, at most ``timeout`` seconds.

    Raises :class:`SyncTimeoutError` past the timeout, or an :class:`AiosyncError` naming
    the version with the hook's own error as its cause.
    """
    with anyio.move_on_after(timeout) as scope:
        try:
            if is_async(hook):
                await _awaited(hook, version)
            else:
                await anyio.to_thread.run_sync(_in_thread, hook, version, abandon_on_cancel=True)
        except Exception as exc:
            raise AiosyncError(f"on_live hook failed: {exc!r}", version=version) from exc
    if scope.cancelled_caught:
        raise SyncTimeoutError(
            f"on_live hook did not return within {timeout:g}s (swap_timeout); a hook running"
            " in a worker thread is not interrupted",
            version=version,
        )


async def _awaited(hook: OnLive, version: int) -> Any:
    awaitable: Awaitable[Any] = hook(version)  # type: ignore[assignment]
    return await awaitable
