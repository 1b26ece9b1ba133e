"""How the collective plane's group meets: the trainer's rendezvous and an engine's joining.

The trainer (rank 0) hosts the store (:class:`TrainerMeeting`): on loopback, by default, a
``FileStore`` in a private directory (:mod:`aiosync.collectives.file_store`), which other
users cannot open; otherwise a ``TCPStore`` on the chosen address
(:mod:`aiosync.collectives.rendezvous`). Each engine session gets a fresh secret in its
hello (:meth:`TrainerMeeting.issue_secret`), never written to the store. Both sides then:

- claim a rank and wait, in polls a closing plane stops, for every engine rank;
- make the group with a store they let go of as soon as it formed
  (:class:`~aiosync.collectives.rendezvous.HeldStore`): a ``TCPStore`` server stops then,
  so it listens, and can be written to, only while the group meets;
- prove every rank before any weight moves (:mod:`aiosync.collectives.admission`).

An engine reaches a ``TCPStore`` through a :class:`~aiosync.collectives.store_dialer.
StoreDialer`, which its plane cuts when it closes or its deadline passes, and a failed join
clears its frames so that no store (and no descriptor) outlives the error.
"""

from __future__ import annotations

import ipaddress
import threading
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Literal, TypeVar

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store

from aiosync.collectives import ops
from aiosync.collectives.admission import admit_ranks, claim_rank, prove_rank, wait_for_ranks
from aiosync.collectives.alias_store import AliasStore, rank_alias
from aiosync.collectives.deadline import Deadline
from aiosync.collectives.executor import GroupExecutor
from aiosync.collectives.file_store import FileRendezvous
from aiosync.collectives.process_group import init_process_group
from aiosync.collectives.rank_proofs import new_secret
from aiosync.collectives.rendezvous import (
    LOOPBACK,
    HeldStore,
    HostedStore,
    host_store,
    new_token,
    token_store,
)
from aiosync.collectives.store_dialer import StoreDialer
from aiosync.core.wire import CollectivePlaneSpec

T = TypeVar("T")

Rendezvous = Literal["auto", "file", "tcp"]
RENDEZVOUS: tuple[Rendezvous, ...] = ("auto", "file", "tcp")


def file_rendezvous(rendezvous: str, host: str, interface: str | None) -> bool:
    """Whether a group meets through a private file: ``"file"``, or ``"auto"`` on loopback."""
    if rendezvous == "tcp":
        return False
    on_loopback = interface is None and ipaddress.ip_address(host).is_loopback
    if rendezvous == "file" and not on_loopback:
        raise ValueError("rendezvous='file' meets on this host only: leave host and interface")
    return on_loopback


def forgetting(job: Callable[[], T]) -> Callable[[], T]:
    """``job``, whose error keeps none of its frames' locals (stores, sockets) alive."""

    def run() -> T:
        try:
            return job()
        except BaseException as exc:
            seen: set[int] = set()
            error: BaseException | None = exc
            while error is not None and id(error) not in seen:
                seen.add(id(error))
                traceback.clear_frames(error.__traceback__)
                error = error.__cause__ or error.__context__
            raise

    return run


class TrainerMeeting:
    """Rank 0's side of one group's rendezvous: its store, name, token and engine secrets."""

    def __init__(self, name: str, *, file: bool, host: str, timeout: float) -> None:
        self.name = name
        self.token = new_token()
        self.timeout = timeout
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._secrets: list[str] = []
        self._file: FileRendezvous | None = None
        self._hosted: HostedStore | None = None
        if file:
            self._file = FileRendezvous()
            self.host, self.port, self.path = LOOPBACK, 0, self._file.path
        else:
            self._hosted = host_store(host, timeout=timedelta(seconds=timeout))
            self.host, self.port, self.path = self._hosted.host, self._hosted.port, ""

    def issue_secret(self) -> str:
        """A fresh secret for one more engine session (each may prove one rank)."""
        secret = new_secret()
        with self._lock:
            self._secrets.append(secret)
        return secret

    def join(self, executor: GroupExecutor, backend: str, device: torch.device, world: int) -> None:
        """Meet the engines as rank 0 and admit them (on the group's thread; blocking)."""
        wait, deadline = timedelta(seconds=self.timeout), Deadline.after(self.timeout)
        held = HeldStore(self._store(wait))
        try:
            wait_for_ranks(held, world, deadline, self._stopped, self.name)
            executor.group = init_process_group(
                backend, store=held, world_size=world, rank=0, group_name=self.name,
                timeout=wait,
            )  # fmt: skip
            ops.connect(executor.group, device, deadline)
            with self._lock:
                issued = list(self._secrets)
            names = (self.name, self.token)
            admit_ranks(executor.group, device, world, issued, names, deadline)
        finally:
            held.release()
            self._hosted = None  # a TCPStore server stops with its last reference

    def _store(self, wait: timedelta) -> Store:
        if self._file is not None:
            return token_store(self._file.store(wait), self.token)
        if self._hosted is None:
            raise RuntimeError(f"group {self.name}: the rendezvous is closed")
        return token_store(self._hosted.store, self.token)

    def close(self) -> None:
        """Stop a rendezvous still waiting, let go of the store, remove a private file."""
        self._stopped.set()
        self._hosted = None
        if self._file is not None:
            self._file.close()


def join_engine(
    spec: CollectivePlaneSpec,
    executor: GroupExecutor,
    device: torch.device,
    base: Callable[[timedelta], Store],
    stopped: threading.Event,
    timeout: float,
) -> int:
    """An engine's join: claim a rank, meet, prove it; returns the rank (blocking).

    ``base`` opens the trainer's store (a checked ``FileStore``, or a dialer's client);
    ``timeout`` is the engine's, the peer's capped by its own.
    """
    wait, deadline = timedelta(seconds=timeout), Deadline.after(timeout)
    store = token_store(base(wait), spec.token)
    rank = claim_rank(store, spec.world_size, spec.group)
    wait_for_ranks(store, spec.world_size, deadline, stopped, spec.group)
    # torch names a group once per process: the trainer (rank 0) may live in this one
    alias = rank_alias(spec.group, rank)
    held = HeldStore(AliasStore(store, alias, spec.group))
    del store
    try:
        group: dist.ProcessGroup = init_process_group(
            spec.backend, store=held, world_size=spec.world_size, rank=rank, group_name=alias,
            timeout=wait,
        )  # fmt: skip
        executor.group = group
        ops.connect(group, device, deadline)
        names = (spec.group, spec.token)
        prove_rank(group, device, rank, spec.world_size, spec.secret, names, deadline)
    finally:
        held.release()
    return rank


def dialer_for(spec: CollectivePlaneSpec) -> StoreDialer | None:
    """The dialer of a spec's ``TCPStore`` (``None`` for a file rendezvous)."""
    return None if spec.store_path else StoreDialer(spec.host, spec.port)
