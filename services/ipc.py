"""ZMQ sockets between the three processes (see `services.io_struct`), and peer liveness.

Each PULL socket binds (an ipc:// socket, or a port of 127.0.0.1) and its PUSH peer
connects, so startup order is free (ZMQ reconnects). With `WireKeys` the wire is
authenticated both ways: each PULL socket is a CURVE server and each PUSH socket a CURVE
client with its role's keypair, and a `WireAuthenticator` (ZAP) in each binding process
admits only the pod's own client keys, so a local process without them cannot connect, let
alone inject, abort or retire anything (CURVE alone would authenticate only the server).

Sends never block a loop: a PUSH socket only queues for a connected peer
(`zmq.IMMEDIATE`) and up to its high-water mark; past that `Sender.send` returns
False and the caller decides (fail the request with a clear error); an `Outbox` holds a
stream of outputs across a peer's short absence instead. Receivers drop bytes
that are not a valid message instead of raising. `PeerMonitor` turns the `Hello` /
`Heartbeat` stream into "alive", "dead" (three missed heartbeats) and "restarted" (a new
epoch), and rejects messages from a restarted peer's previous life.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import stat
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple

import msgspec
import zmq
import zmq.asyncio
import zmq.auth
import zmq.utils.monitor as zmq_monitor
from zmq.utils import z85

from services.io_struct import Heartbeat, Hello, Message, ProtocolError, decode, encode

logger = logging.getLogger(__name__)

LOCALHOST = "127.0.0.1"
DEFAULT_HWM = 10_000
"""Messages queued per socket before sends report failure (requests, or output batches)."""
DEFAULT_LINGER_MS = 100
"""How long close() may wait to flush queued messages: short, so a stopping process stops."""
MAX_MESSAGE_BYTES = 64 * 2**20
"""A peer sending more in one message is disconnected (a 128k-token prompt is ~0.6 MB)."""
WARN_INTERVAL_S = 5.0
"""At most one warning per socket per this many seconds, with a count of what was dropped."""
MAX_HELD_MESSAGES = 10_000
"""Messages an `Outbox` holds for an unreachable peer before it drops the oldest."""
WIRE_ROLES = ("tokenizer", "worker", "detokenizer")
"""The roles with a keypair in a keys directory: `<role>.key` (public key) and
`<role>.key_secret` (both keys), in zmq.auth's certificate format."""
ZAP_DOMAIN = "radixserve"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
"""Where libzmq asks a context's ZAP handler about each CURVE handshake (RFC 27)."""


class WireKeysError(ValueError):
    """A keys directory that is missing, incomplete or readable by other users."""


@dataclass(frozen=True)
class WireKeys:
    """One process's CURVE keypair and the public keys of every role of its pod, read from
    a keys directory (`create_wire_keys`)."""

    role: str
    public: bytes
    """Z85-encoded, as are all the keys here (libzmq takes them so)."""
    secret: bytes
    publics: Mapping[str, bytes]
    """Role → public key: the servers this process connects to, and the clients it admits."""

    @classmethod
    def load(cls, directory: str | os.PathLike[str], role: str) -> WireKeys:
        path = Path(directory)
        secret_file = path / f"{role}.key_secret"
        try:
            mode = secret_file.stat().st_mode
            if mode & stat.S_IRWXO:
                raise WireKeysError(
                    f"{secret_file} is accessible to other users (mode {stat.filemode(mode)}); "
                    "the wire keys must be readable by their owner (and group) only"
                )
            public, secret = zmq.auth.load_certificate(secret_file)
            publics = {r: zmq.auth.load_certificate(path / f"{r}.key")[0] for r in WIRE_ROLES}
        except (OSError, ValueError) as e:
            if isinstance(e, WireKeysError):
                raise
            raise WireKeysError(
                f"cannot read the wire keys of {role} in {path}: {e} (make them with "
                "`radixserve keys DIR` and give all three processes --ipc-keys-dir DIR)"
            ) from e
        if secret is None:
            raise WireKeysError(f"{secret_file} holds no secret key")
        return cls(role, public, secret, publics)


def load_wire_keys(directory: str | None, role: str) -> WireKeys | None:
    """`role`'s keys from `directory` (`--ipc-keys-dir`); None, with a loud warning, when
    there is none: the process then talks plain ZMQ that any local process can join.
    `radixserve serve` and the chart always give keys; only a process started by hand (or
    built in-process by a test) runs without."""
    if directory is not None:
        return WireKeys.load(directory, role)
    logger.warning(
        "%s: no --ipc-keys-dir: the ZMQ wire is NOT authenticated, and any process on this "
        "host can inject, abort or retire requests (make keys with `radixserve keys DIR`)",
        role,
    )
    return None


def create_wire_keys(directory: str | os.PathLike[str]) -> Path:
    """A keypair for every role in `directory` (made if absent), private to this user: the
    directory 0700, its files 0600. A role whose two files are there keeps them: a rerun
    (Kubernetes reruns init containers when a pod's sandbox restarts; podman restarts them
    with the pod's policy) must not change keys that running processes have loaded."""
    path = Path(directory)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)
    for role in WIRE_ROLES:
        if (path / f"{role}.key").is_file() and (path / f"{role}.key_secret").is_file():
            continue
        for file in zmq.auth.create_certificates(path, role):
            os.chmod(file, 0o600)
    return path


class WireAuthenticator(zmq.auth.Authenticator):
    """The ZAP handler of one context: admits a CURVE client only if its public key is one
    of the pod's (`WireKeys.publics`), and warns (rate-limited) about the others.

    Its thread answers libzmq on a socket the context does not track, so the owner's
    `ctx.destroy()` ends it (the blocked receive raises ETERM, the thread closes the
    socket) with no stop call to forget. Start it before binding a CURVE server socket:
    those enforce ZAP and refuse every client while no handler is bound."""

    def __init__(self, ctx: zmq.Context, keys: WireKeys):
        super().__init__(ctx, log=logging.getLogger(f"{__name__}.zap"))
        self.roles = {key: role for role, key in keys.publics.items()}
        """Z85 public key (as `WireKeys` holds them, and as zmq.auth asks) → role."""
        self.configure_curve_callback(ZAP_DOMAIN, self)
        self._refused = _Throttle()
        self._thread = threading.Thread(target=self._serve, name="zap", daemon=True)

    def start(self) -> None:
        self.zap_socket = zmq.Socket(self.context, zmq.REP)
        self.zap_socket.setsockopt(zmq.LINGER, 0)
        self.zap_socket.bind(ZAP_ENDPOINT)
        self._thread.start()

    def callback(self, domain: str, key: bytes) -> bool:
        """zmq.auth's credentials check: is `key` (Z85) one of the pod's?"""
        if key in self.roles:
            return True
        refused = self._refused.hit()
        if refused:
            logger.warning(
                "refused %d ZMQ connection(s) with an unknown CURVE key (latest %s)",
                refused,
                key.decode(errors="replace"),
            )
        return False

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.roles[z85.encode(client_public_key)]

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            while True:
                loop.run_until_complete(self.handle_zap_message(self.zap_socket.recv_multipart()))
        except zmq.ContextTerminated:
            pass
        finally:
            self.zap_socket.close()
            loop.close()


Address = int | str
"""Where a PULL socket binds: a port of tcp://127.0.0.1 (0: a free one), or a ZMQ endpoint,
such as the ipc:// sockets `radixserve serve` puts in a private directory by default."""


def endpoint(address: Address) -> str:
    """The ZMQ endpoint of `address`."""
    if isinstance(address, int):
        return f"tcp://{LOCALHOST}:{address or '*'}"
    return address


def bind_pull(
    ctx: zmq.Context, address: Address, hwm: int = DEFAULT_HWM, keys: WireKeys | None = None
) -> zmq.Socket:
    """A PULL socket on `address`: loopback TCP (never all interfaces: the processes share a
    pod or a host, and nothing else may inject requests) or ipc://. Port 0 picks a free port;
    read it back with `bound_port`. With `keys` it is a CURVE server that admits only the
    clients `ctx`'s `WireAuthenticator` admits."""
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
        sock.setsockopt_string(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    where = endpoint(address)
    try:
        if where.startswith("ipc://"):
            _refuse_live_ipc(where.removeprefix("ipc://"))
        sock.bind(where)
    except zmq.ZMQError as e:
        sock.close()
        raise OSError(
            e.errno,
            f"cannot bind {where}: {e.strerror} (another process holds the port? "
            "each port has a --*-port flag)",
        ) from e
    except OSError:
        sock.close()
        raise
    return sock


def _refuse_live_ipc(path: str) -> None:
    """OSError if a socket listens on the Unix socket `path`: binding an ipc:// endpoint
    replaces the file, which would silently cut its owner off instead of failing."""
    if not os.path.exists(path):
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
        except OSError:
            return  # a file left by a process that is gone: binding replaces it
    raise OSError(errno.EADDRINUSE, f"cannot bind ipc://{path}: a socket already listens on it")


def bound_port(sock: zmq.Socket) -> int:
    return int(sock.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])


def connect_push(
    ctx: zmq.Context,
    address: Address,
    hwm: int = DEFAULT_HWM,
    linger_ms: int = DEFAULT_LINGER_MS,
    keys: WireKeys | None = None,
    server: str = "",
) -> zmq.Socket:
    """A PUSH socket to `address` (as `bind_pull` takes it) that queues only while the peer
    is connected (`IMMEDIATE`): messages for an absent peer are refused at once, not
    delivered to a restarted peer long after their requests were failed. With `keys` it is
    a CURVE client that talks only to the role `server` (its public key) and proves it is
    `keys.role`."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.IMMEDIATE, 1)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.LINGER, linger_ms)
    if keys is not None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys.publics[server])
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.connect(endpoint(address))
    return sock


class _Throttle:
    """Counts events and says when a warning about them is due (at most one per interval)."""

    def __init__(self, interval: float = WARN_INTERVAL_S):
        self.interval = interval
        self.count = 0
        self._last_warn = -float("inf")

    def hit(self) -> int:
        """Record one event; return how many happened since the last warning if one is due
        now, else 0."""
        self.count += 1
        now = time.monotonic()
        if now - self._last_warn < self.interval:
            return 0
        self._last_warn, count, self.count = now, self.count, 0
        return count


class Sender:
    """Non-blocking sends of protocol messages, stamped with this process's role and epoch.

    Needs a plain (not asyncio) socket: a NOBLOCK send never waits, so it is safe inside an
    event loop, and it reports failure as a return value rather than a failed future."""

    def __init__(self, sock: zmq.Socket, sender: str, epoch: str, heartbeat_interval: float = 1.0):
        if isinstance(sock, zmq.asyncio.Socket):
            raise TypeError(
                "Sender needs a plain zmq socket (from zmq.Context), not a zmq.asyncio one"
            )
        self.sock = sock
        self.sender = sender
        self.epoch = epoch
        self.heartbeat_interval = heartbeat_interval
        self._last_heartbeat = -float("inf")
        self._dropped = _Throttle()

    def send(self, msg: Message) -> bool:
        """Queue `msg` for the peer; False (and a rate-limited warning) when no peer is
        connected or the queue is full. Never blocks."""
        msg = msgspec.structs.replace(msg, sender=self.sender, epoch=self.epoch)
        try:
            self.sock.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            if isinstance(msg, (Hello, Heartbeat)):
                return False  # expected while the peer is down or connecting; the next one follows
            dropped = self._dropped.hit()
            if dropped:
                logger.warning(
                    "%s → %s: peer not connected or send queue full; "
                    "dropped %d message(s) (latest %s)",
                    self.sender,
                    self.sock.getsockopt_string(zmq.LAST_ENDPOINT),
                    dropped,
                    type(msg).__name__,
                )
            return False
        return True

    def hello(self) -> bool:
        return self.send(Hello())

    def heartbeat_if_due(self) -> None:
        """Send a Heartbeat if `heartbeat_interval` has passed since the last attempt; call it
        from the process's loop at least that often."""
        now = time.monotonic()
        if now - self._last_heartbeat >= self.heartbeat_interval:
            self._last_heartbeat = now
            self.send(Heartbeat())


class Outbox:
    """Messages to one peer that must arrive, in order, across a short disconnection: a
    restarting peer, or this side's reconnection to a peer that restarted (its first
    ~100 ms). `put` sends at once when the peer is connected and otherwise holds the message;
    `flush` (each loop turn) sends what is held, oldest first. A lost output batch would
    leave its requests waiting for tokens that never come, or with text missing.

    Held messages are bounded (`max_held`): past it the oldest are dropped, with a warning.
    A peer that stays away that long has been declared dead by the tokenizer, whose
    requests failed and were aborted anyway."""

    def __init__(self, sender: Sender, max_held: int = MAX_HELD_MESSAGES):
        self.sender = sender
        self.max_held = max_held
        self.held: deque[Message] = deque()
        self._dropped = _Throttle()

    def __len__(self) -> int:
        return len(self.held)

    def put(self, msg: Message) -> None:
        self.held.append(msg)
        self.flush()

    def flush(self) -> None:
        while (
            self.held and self.sender.sock.poll(0, zmq.POLLOUT) and self.sender.send(self.held[0])
        ):
            self.held.popleft()
        while len(self.held) > self.max_held:
            msg = self.held.popleft()
            dropped = self._dropped.hit()
            if dropped:
                logger.warning(
                    "%s: peer unreachable; held %d message(s), dropped %d (latest %s)",
                    self.sender.sender,
                    len(self.held),
                    dropped,
                    type(msg).__name__,
                )


class _Decoder:
    """Frames → message, or None with a rate-limited warning: bad bytes are never fatal."""

    def __init__(self, name: str):
        self.name = name
        self._bad = _Throttle()

    def __call__(self, frames: list[bytes]) -> Message | None:
        try:
            if len(frames) != 1:
                raise ProtocolError(f"expected one frame, got {len(frames)}")
            return decode(frames[0])
        except ProtocolError as e:
            dropped = self._bad.hit()
            if dropped:
                logger.warning(
                    "%s: dropped %d malformed message(s); latest: %s", self.name, dropped, e
                )
            return None


class Receiver:
    """Drains a PULL socket into decoded messages, dropping malformed ones."""

    def __init__(self, sock: zmq.Socket, name: str = "receiver"):
        self.sock = sock
        self._decode = _Decoder(name)

    def recv_all(self, timeout_ms: int | None = 0, limit: int | None = None) -> list[Message]:
        """Wait up to `timeout_ms` (None: forever) for a message, then return everything
        queued (at most `limit`, so one flood cannot starve the caller's loop)."""
        if not self.sock.poll(timeout_ms, zmq.POLLIN):
            return []
        messages: list[Message] = []
        while limit is None or len(messages) < limit:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            msg = self._decode(frames)
            if msg is not None:
                messages.append(msg)
        return messages


class Connections:
    """The connections open into a bound socket, from ZMQ's socket monitor: a peer whose
    process exits drops them at once (the kernel closes its sockets); a busy one never
    does. Works for asyncio sockets too: the events are read on a plain socket of the same
    libzmq context. `close` it before that context is destroyed."""

    def __init__(self, sock: zmq.Socket):
        address = f"inproc://connections-{id(self):x}"
        sock.monitor(address, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.events: zmq.Socket = zmq.Context.shadow(sock.context.underlying).socket(zmq.PAIR)
        self.events.connect(address)
        self.open = 0

    def count(self) -> int:
        """Connections open now (the events since the last call applied)."""
        while self.events.poll(0):
            event = zmq_monitor.parse_monitor_message(self.events.recv_multipart())
            self.open += 1 if event["event"] == zmq.EVENT_ACCEPTED else -1
        return self.open

    def close(self) -> None:
        self.events.close(linger=0)


class AsyncReceiver:
    """The tokenizer's side: `await recv()` yields the next valid message from a
    `zmq.asyncio` PULL socket, dropping malformed ones."""

    def __init__(self, sock: zmq.asyncio.Socket, name: str = "receiver"):
        self.sock = sock
        self._decode = _Decoder(name)

    async def recv(self) -> Message:
        while True:
            msg = self._decode(await self.sock.recv_multipart())
            if msg is not None:
                return msg


class PeerEvent(NamedTuple):
    peer: str
    kind: Literal["up", "restart", "dead"]
    """up: first seen, or heard from again after being dead; restart: a new epoch (its
    previous life's requests are lost); dead: `misses` heartbeat intervals of silence."""
    epoch: str


@dataclass
class _Peer:
    epoch: str
    last_seen: float
    alive: bool = True
    retired: set[str] = field(default_factory=set)
    """Epochs this peer has had before: their messages are stale."""
    connected: bool = True
    """It has a connection into this process (as far as `connections` was told)."""


class PeerMonitor:
    """Liveness and epochs of the peers a process receives from, keyed by sender role.

    Any stamped message counts as a sign of life (Hello and Heartbeat carry nothing else).
    A peer is judged dead on evidence that it stopped, not on one late heartbeat (a busy
    host delays a beat by seconds): silent for `misses` intervals with no connection into
    this process (`connections`: its process exited, and the kernel closed its sockets), or
    silent for `timeout` whatever its connections say (frozen, or its host gone).
    Epochs are compared for identity, not order: an epoch seen before the current one is
    retired, and its messages are rejected."""

    def __init__(self, interval: float = 1.0, misses: int = 3, timeout: float | None = None):
        self.interval = interval
        self.misses = misses
        self.timeout = max(misses * interval, timeout if timeout is not None else 0.0)
        self._peers: dict[str, _Peer] = {}
        self._events: list[PeerEvent] = []

    def connections(self, count: int, peer: str | None = None) -> None:
        """`peer` (None: every peer) has `count` connections into this process now."""
        for name, state in self._peers.items():
            if peer is None or name == peer:
                state.connected = count > 0

    def accept(self, msg: Message) -> bool:
        """Record `msg`'s sender as alive; False if it comes from a retired epoch (drop it).
        Unstamped messages (no sender) are accepted: there is nothing to judge them by."""
        if not msg.sender:
            return True
        now = time.monotonic()
        peer = self._peers.get(msg.sender)
        if peer is None:
            self._peers[msg.sender] = _Peer(msg.epoch, now)
            self._events.append(PeerEvent(msg.sender, "up", msg.epoch))
            return True
        if msg.epoch in peer.retired:
            return False
        if msg.epoch != peer.epoch:
            # Its Hello may have been refused while the connection came up, so the first
            # message of a new life need not be a Hello.
            peer.retired.add(peer.epoch)
            peer.epoch, peer.alive = msg.epoch, True
            self._events.append(PeerEvent(msg.sender, "restart", msg.epoch))
        elif not peer.alive:
            peer.alive = True
            self._events.append(PeerEvent(msg.sender, "up", msg.epoch))
        peer.last_seen = now
        return True

    def is_alive(self, peer: str) -> bool:
        """Not yet silent for the limit that applies (never heard from: False)."""
        state = self._peers.get(peer)
        if state is None:
            return False
        silent = time.monotonic() - state.last_seen
        return silent <= (self.timeout if state.connected else self.misses * self.interval)

    def epoch(self, peer: str) -> str | None:
        state = self._peers.get(peer)
        return None if state is None else state.epoch

    def poll(self, check_deaths: bool = True) -> list[PeerEvent]:
        """Events since the last poll, deaths included (found here, so call it each loop);
        each transition is reported once. `check_deaths=False` only hands over the events
        `accept` recorded: call it after each message, so that a restart is acted on before
        the messages of the peer's new life; judge deaths only once every socket is drained."""
        for name, state in self._peers.items():
            if check_deaths and state.alive and not self.is_alive(name):
                state.alive = False
                self._events.append(PeerEvent(name, "dead", state.epoch))
        events, self._events = self._events, []
        return events
