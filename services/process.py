"""The loop the worker and the detokenizer share: one PULL socket in, PUSH sockets out,
Hello at start, heartbeats while alive, peer liveness, and a clean exit on SIGTERM/SIGINT.

A service subclasses `Service` and implements `handle` (one non-liveness message) and,
if it computes between messages, `has_work` and `step` — or, when its computation is a
loop of its own (the worker's scheduler), overrides `serve` to run that loop with `poll`
as its once-a-turn message hook. The loop never spins: `poll` waits for nothing only
while `has_work()` is true, and otherwise sleeps until a message arrives or a peer may
have died. Each service also serves `/metrics` and `/healthz` on its metrics port;
`/healthz` fails once the loop stops turning.

Heartbeats go out from a thread of their own, so that a long scheduler round (a big
prefill on a CPU) is not mistaken for a death; that thread's watchdog ends a process whose
loop has stopped making progress (a turn, or a layer of a long forward), so that its peers
do see a death and Kubernetes restarts it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import types
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Protocol

import zmq
from prometheus_client import CollectorRegistry

from observability.metrics_server import MetricsServer, start_metrics_server
from observability.tracing import setup_tracing
from services.io_struct import Heartbeat, Hello, Message, new_epoch
from services.ipc import (
    Address,
    Connections,
    Outbox,
    PeerEvent,
    PeerMonitor,
    Receiver,
    Sender,
    WireAuthenticator,
    bind_pull,
    connect_push,
    load_wire_keys,
)
from services.preflight import exit_if_refused
from services.settings import Settings

logger = logging.getLogger(__name__)

RECV_BATCH_LIMIT = 1024
"""Messages taken per loop turn, so a flood cannot starve the scheduler step."""
WATCHDOG_EXIT_CODE = 3
"""Exit status of a process its watchdog ended (distinct from a crash's 1)."""
HELD_RETRY_MS = 10
"""How often an idle loop retries messages its outboxes hold for an unreachable peer."""


def configure_logging(level: str, role: str) -> None:
    """One line per event, on stderr, tagged with the process role (the three processes
    usually share a terminal or a pod's log stream)."""
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


class Service(ABC):
    """A process on the wire: receives on `in_address`, sends through `connect(address)`
    (a loopback port, or an endpoint such as `Settings.zmq_address` gives)."""

    role: str = ""

    def __init__(self, settings: Settings, in_address: Address):
        self.settings = settings
        self.epoch = new_epoch()
        self.keys = load_wire_keys(settings.ipc_keys_dir, self.role)
        self.ctx = zmq.Context()
        if self.keys is not None:
            WireAuthenticator(self.ctx, self.keys).start()
        self.receiver = Receiver(bind_pull(self.ctx, in_address, keys=self.keys), name=self.role)
        self.connections = Connections(self.receiver.sock)
        """Of the one role that sends to this process (`Settings.zmq_role` of its address)."""
        self.monitor = PeerMonitor(settings.heartbeat_interval, timeout=settings.peer_timeout)
        self.senders: list[Sender] = []
        self.outboxes: list[Outbox] = []
        self.peer_addresses: list[Address] = []
        self.heartbeats = threading.Thread(
            target=self._heartbeat_loop, name="heartbeats", daemon=True
        )
        self.stopping = False
        self.registry = CollectorRegistry()
        self.metrics_server: MetricsServer | None = None
        self.tracing = setup_tracing(self.role)
        self.last_turn = time.monotonic()
        """When the loop last polled (once a turn)."""
        self.last_progress = self.last_turn
        """When the loop last showed progress: a turn, or a layer of a long forward
        (`mark_progress`); /healthz and the watchdog judge by it."""
        # Half an interval: a peer's death is noticed within 3.5 intervals of its last beat.
        self.idle_timeout_ms = max(1, int(settings.heartbeat_interval * 500))

    def serve_metrics(self, port: int | None) -> None:
        """Start `/metrics` (of `self.registry`) and `/healthz` on `settings.host` (port
        None: a free one, logged)."""
        self.metrics_server = start_metrics_server(
            self.settings.host, port or 0, self.registry, self.stalled
        )

    def stalled(self) -> str | None:
        """Why the loop looks stuck, or None while it turns or computes."""
        idle = self.idle()
        if idle < self.settings.stall_timeout:
            return None
        return f"the {self.role} loop has made no progress for {idle:.0f} s"

    def idle(self) -> float:
        """Seconds since the loop last showed progress."""
        return time.monotonic() - max(self.last_turn, self.last_progress)

    def mark_progress(self) -> None:
        """The loop computes: a long forward finished one more layer (any thread)."""
        self.last_progress = time.monotonic()

    def connect(self, address: Address) -> Sender:
        sender = Sender(
            self._connect_push(address), self.role, self.epoch, self.settings.heartbeat_interval
        )
        self.senders.append(sender)
        self.peer_addresses.append(address)
        return sender

    def _connect_push(self, address: Address) -> zmq.Socket:
        """A PUSH socket to the peer that binds `address`, authenticated as this role."""
        return connect_push(
            self.ctx, address, keys=self.keys, server=self.settings.zmq_role(address)
        )

    def outbox(self, address: Address) -> Outbox:
        """`connect(address)` for messages that must not be lost to a short disconnection."""
        outbox = Outbox(self.connect(address))
        self.outboxes.append(outbox)
        return outbox

    # ----- what a service implements ----------------------------------------------------

    @abstractmethod
    def handle(self, msg: Message) -> None:
        """React to one message that is not a Hello or a Heartbeat."""

    def has_work(self) -> bool:
        """True while `step` has something to do: the loop then polls without waiting."""
        return False

    # The hooks below are optional: a service overrides those it needs.

    def step(self) -> None:  # noqa: B027
        """Compute between message batches, in `serve`'s default loop."""

    def on_peer_event(self, event: PeerEvent) -> None:  # noqa: B027
        """A peer came up, restarted or went silent (already logged)."""

    # ----- the loop ---------------------------------------------------------------------

    def serve_forever(self) -> None:
        """Run until SIGTERM or SIGINT, then close the sockets and return."""
        previous = {
            sig: signal.signal(sig, self._request_stop) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            for sender in self.senders:
                sender.hello()
            self.heartbeats.start()
            logger.info("%s serving (epoch %s)", self.role, self.epoch)
            self.serve(lambda: self.stopping)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.close()
        logger.info("%s stopped", self.role)

    def serve(self, should_stop: Callable[[], bool]) -> None:
        """The loop, until `should_stop()`: each turn polls, then steps while there is work."""
        while not should_stop():
            self.poll()
            if self.has_work():
                self.step()

    def poll(self) -> None:
        """A turn's messaging: flush the outboxes, receive (without waiting while there is
        work), handle the messages and the peers' events; then `last_turn` is now."""
        held = False
        for outbox in self.outboxes:
            outbox.flush()
            held = held or len(outbox) > 0
        if self.has_work():
            timeout_ms = 0
        else:
            timeout_ms = HELD_RETRY_MS if held else self.idle_timeout_ms
        for msg in self.receiver.recv_all(timeout_ms, limit=RECV_BATCH_LIMIT):
            accepted = self.monitor.accept(msg)
            # A peer's restart is acted on before the first message of its new life.
            self._dispatch_peer_events(self.monitor.poll(check_deaths=False))
            if accepted and not isinstance(msg, (Hello, Heartbeat)):
                try:
                    self.handle(msg)
                except Exception:  # a message must never take the process down
                    logger.exception("dropped %s after an error handling it", type(msg).__name__)
        self.monitor.connections(self.connections.count())
        self._dispatch_peer_events(self.monitor.poll())
        self.last_turn = time.monotonic()

    def _dispatch_peer_events(self, events: list[PeerEvent]) -> None:
        for event in events:
            logger.info("peer %s %s (epoch %s)", event.peer, event.kind, event.epoch)
            try:
                self.on_peer_event(event)
            except Exception:  # as with a message: log it, keep serving
                logger.exception("error handling peer %s %s", event.peer, event.kind)

    def _heartbeat_loop(self) -> None:
        """Beat to every peer on sockets of this thread's own (a zmq socket belongs to one
        thread); exit the process once the loop has not turned for `watchdog_timeout`."""
        senders = [
            Sender(
                self._connect_push(address),
                self.role,
                self.epoch,
                self.settings.heartbeat_interval,
            )
            for address in self.peer_addresses
        ]
        try:
            while not self.stopping:
                for sender in senders:
                    sender.heartbeat_if_due()
                idle = self.idle()
                if idle > self.settings.watchdog_timeout:
                    logger.critical(
                        "watchdog: the %s loop has made no progress for %.0f s "
                        "(--watchdog-timeout %g); exiting",
                        self.role,
                        idle,
                        self.settings.watchdog_timeout,
                    )
                    logging.shutdown()
                    os._exit(WATCHDOG_EXIT_CODE)
                time.sleep(self.settings.heartbeat_interval / 2)
        finally:
            for sender in senders:
                sender.sock.close(linger=0)

    def close(self) -> None:
        self.stopping = True
        if self.heartbeats.is_alive():
            self.heartbeats.join()
        if self.metrics_server is not None:
            self.metrics_server.close()
        if self.tracing is not None:
            self.tracing.shutdown()
        self.connections.close()
        self.ctx.destroy(linger=100)

    def _request_stop(self, signum: int, frame: types.FrameType | None) -> None:
        logger.info("%s received %s; stopping", self.role, signal.Signals(signum).name)
        self.stopping = True


class ServiceClass(Protocol):
    """A concrete service: its role, and its constructor from the settings alone."""

    role: str

    def __call__(self, settings: Settings) -> Service: ...


def run_service(service_cls: ServiceClass) -> None:
    """`python -m services.<role>`: settings from flags and RADIXSERVE_* variables, logging,
    then the service's loop until SIGTERM/SIGINT; files it cannot serve are refused first."""
    prog = f"python -m services.{service_cls.role}"
    settings = Settings.from_cli(prog=prog, wire=True)
    configure_logging(settings.log_level, service_cls.role)
    exit_if_refused(settings, prog)
    service_cls(settings).serve_forever()
