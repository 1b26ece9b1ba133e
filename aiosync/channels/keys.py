"""CURVE keys for ZMQ channels: the key files ``aiosync keygen`` writes, and :class:`ChannelAuth`.

A keypair lives in two files made by :func:`generate_keypair` (``aiosync keygen DIR
--name NAME``): ``NAME.key`` holds the public key, to hand to the other side, and
``NAME.key_secret`` holds both keys, readable by its owner only (mode 0600). Keys are the
40-character Z85 text ZMQ uses.

The side that binds is the CURVE server: it has a keypair and the public keys of the
clients it lets in. A side that connects has a keypair of its own and knows the server's
public key. Either role may be the engine's or the trainer's. Which endpoints need keys at
all is decided in :mod:`aiosync.channels.zmq_common`: ``tcp://`` always does, unless
``insecure_loopback`` is set and the address is a loopback one.

zmq is imported inside the functions, so importing :class:`ChannelAuth` is cheap.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import tempfile
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from aiosync.core.errors import AiosyncError

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")

KeyPath = str | os.PathLike[str]


def z85_key(key: bytes | str, what: str = "key") -> bytes:
    """``key`` as 40 bytes of Z85 text; raw 32-byte keys are encoded. AiosyncError if not a key."""
    from zmq.utils import z85

    raw = key.encode("ascii", "replace") if isinstance(key, str) else bytes(key)
    if len(raw) == 32:
        return z85.encode(raw)
    if len(raw) == 40:
        try:
            if len(z85.decode(raw)) == 32:
                return raw
        except (ValueError, KeyError, TypeError):
            pass
    raise AiosyncError(f"{what} is not a CURVE key (40 characters of Z85 text, or 32 raw bytes)")


@dataclass(frozen=True)
class ChannelAuth:
    """How one side of a ZMQ channel authenticates (all keys as Z85 bytes).

    ``public_key`` and ``secret_key``: this side's keypair. ``server_key``: the public key
    of the side that binds, needed to connect. ``allowed_clients``: the public keys a
    binding side lets in; any other key is refused during the handshake, before a message
    gets through. ``insecure_loopback``: allow plain, unauthenticated tcp on a loopback
    address (any local user can then connect; tests and single-user machines only).

    :meth:`server` and :meth:`client` build one from key files.
    """

    public_key: bytes | None = None
    secret_key: bytes | None = field(default=None, repr=False)
    server_key: bytes | None = None
    allowed_clients: Collection[bytes] = frozenset()
    insecure_loopback: bool = False

    def __post_init__(self) -> None:
        if (self.public_key is None) != (self.secret_key is None):
            raise AiosyncError("a keypair needs both its public and its secret key")
        if self.public_key is not None and self.secret_key is not None:
            import zmq

            public = z85_key(self.public_key, "public key")
            secret = z85_key(self.secret_key, "secret key")
            if zmq.curve_public(secret) != public:
                raise AiosyncError("the public key does not belong to the secret key")
            object.__setattr__(self, "public_key", public)
            object.__setattr__(self, "secret_key", secret)
        if self.server_key is not None:
            object.__setattr__(self, "server_key", z85_key(self.server_key, "server key"))
        allowed = frozenset(z85_key(key, "allowed client key") for key in self.allowed_clients)
        object.__setattr__(self, "allowed_clients", allowed)

    @classmethod
    def server(cls, keypair: KeyPath, allowed_clients: KeyPath | Iterable[bytes]) -> ChannelAuth:
        """The binding side: its ``.key_secret`` file and the clients it lets in.

        ``allowed_clients`` is a directory of public ``.key`` files, one such file, or keys.
        """
        public, secret = load_keypair(keypair)
        if isinstance(allowed_clients, str | os.PathLike):
            allowed: Iterable[bytes] = load_public_keys(allowed_clients)
        else:
            allowed = allowed_clients
        return cls(public_key=public, secret_key=secret, allowed_clients=frozenset(allowed))

    @classmethod
    def client(cls, keypair: KeyPath, server_key: KeyPath | bytes) -> ChannelAuth:
        """The connecting side: its ``.key_secret`` file and the server's public key (or file)."""
        public, secret = load_keypair(keypair)
        if isinstance(server_key, bytes):
            server = z85_key(server_key, "server key")
        else:
            server = load_public_key(server_key)
        return cls(public_key=public, secret_key=secret, server_key=server)

    @property
    def has_keys(self) -> bool:
        """True when any key is set (the channel then must use CURVE)."""
        return bool(self.public_key or self.server_key or self.allowed_clients)

    def server_keys(self) -> tuple[bytes, bytes, frozenset[bytes]]:
        """(public, secret, allowed clients) for binding; AiosyncError when one is missing."""
        if self.public_key is None or self.secret_key is None:
            raise AiosyncError("binding with CURVE needs this side's keypair")
        if not self.allowed_clients:
            raise AiosyncError("binding with CURVE needs the public keys of the allowed clients")
        return self.public_key, self.secret_key, frozenset(self.allowed_clients)

    def client_keys(self) -> tuple[bytes, bytes, bytes]:
        """(public, secret, server key) for connecting; AiosyncError when one is missing."""
        if self.public_key is None or self.secret_key is None:
            raise AiosyncError("connecting with CURVE needs this side's keypair")
        if self.server_key is None:
            raise AiosyncError("connecting with CURVE needs the server's public key")
        return self.public_key, self.secret_key, self.server_key


# --- key files ---------------------------------------------------------------------------


def _read_certificate(path: Path) -> tuple[bytes, bytes | None]:
    import zmq.auth

    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise AiosyncError(f"cannot read a key from {path}: {exc}") from None
    return z85_key(public, f"public key in {path}"), secret


def load_keypair(path: KeyPath) -> tuple[bytes, bytes]:
    """(public, secret) from a ``.key_secret`` file, which only its owner may read."""
    path = Path(path)
    try:
        info = path.stat()
    except OSError as exc:
        raise AiosyncError(f"cannot read the secret key file {path}: {exc}") from None
    if not stat.S_ISREG(info.st_mode):
        raise AiosyncError(f"secret key file {path} is not a regular file")
    if info.st_mode & 0o077:
        raise AiosyncError(
            f"secret key file {path} may be read by other users "
            f"(mode {stat.S_IMODE(info.st_mode):04o}); run chmod 600 on it"
        )
    public, secret = _read_certificate(path)
    if secret is None:
        raise AiosyncError(f"{path} holds no secret key (give the {SECRET_SUFFIX} file)")
    return public, z85_key(secret, f"secret key in {path}")


def load_public_key(path: KeyPath) -> bytes:
    """The public key in a ``.key`` file (or in a ``.key_secret`` file)."""
    return _read_certificate(Path(path))[0]


def load_public_keys(path: KeyPath) -> frozenset[bytes]:
    """Every public key of a directory's ``*.key`` files, or the one key of a file."""
    path = Path(path)
    if not path.is_dir():
        return frozenset([load_public_key(path)])
    keys = frozenset(load_public_key(p) for p in sorted(path.glob(f"*{PUBLIC_SUFFIX}")))
    if not keys:
        raise AiosyncError(f"no public key files (*{PUBLIC_SUFFIX}) in {path}")
    return keys


def generate_keypair(directory: KeyPath, name: str = "aiosync") -> tuple[Path, Path]:
    """Write a new keypair as ``NAME.key`` and ``NAME.key_secret`` (0600) into ``directory``.

    The directory is created (mode 0700) if absent; existing files are never overwritten.
    The files are written in a private staging directory and linked into place, so the
    secret key is never readable by others, not even for a moment. Returns both paths.
    """
    import zmq.auth

    if not _NAME.fullmatch(name):
        raise AiosyncError(f"bad key name {name!r}: use letters, digits, '.', '_' or '-'")
    target = Path(directory)
    try:
        target.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise AiosyncError(f"cannot create {target}: {exc}") from None
    public, secret = target / f"{name}{PUBLIC_SUFFIX}", target / f"{name}{SECRET_SUFFIX}"
    for path in (public, secret):
        if os.path.lexists(path):
            raise AiosyncError(f"{path} exists; not overwritten")
    staging = Path(tempfile.mkdtemp(prefix=".aiosync-keygen-", dir=target))  # mode 0700
    placed: list[Path] = []
    try:
        staged_public, staged_secret = map(Path, zmq.auth.create_certificates(staging, name))
        staged_secret.chmod(0o600)
        staged_public.chmod(0o644)
        for staged, final in ((staged_secret, secret), (staged_public, public)):
            os.link(staged, final)  # fails rather than replace a file made meanwhile
            placed.append(final)
    except FileExistsError as exc:
        for path in placed:
            path.unlink(missing_ok=True)
        raise AiosyncError(f"{exc.filename2 or exc.filename} exists; not overwritten") from None
    except OSError as exc:
        for path in placed:
            path.unlink(missing_ok=True)
        raise AiosyncError(f"cannot write keys into {target}: {exc}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return public, secret
