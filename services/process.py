"""The loop the worker and the detokenizer share: one PULL socket in, PUSH sockets out,
Hello at start, heartbeats while alive, peer liveness, and a clean exit on SIGTERM/SIGINT.

A service subclasses `Service` and implements `handle` (one non-liveness message) and,
if it computes between messages, `has_work` and `step`. The loop never spins: it polls
without waiting only while `has_work()` is true, and otherwise sleeps in the poll until a
message arrives or a heartbeat falls due.
"""

from __future__ import annotations

import logging
import signal
import sys
import types
from abc import ABC, abstractmethod

import zmq

from services.ipc import (
    PeerEvent,
    PeerMonitor,
    Receiver,
    Sender,
    bind_pull,
    connect_push,
)
from services.protocol import Heartbeat, Hello, Message, new_epoch
from services.settings import Settings

logger = logging.getLogger(__name__)

RECV_BATCH_LIMIT = 1024
"""Messages taken per loop turn, so a flood cannot starve the scheduler step."""


def configure_logging(level: str, role: str) -> None:
    """One line per event, on stderr, tagged with the process role (the three processes
    usually share a terminal or a pod's log stream)."""
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


class Service(ABC):
    """A process on the wire: receives on `in_port`, sends through `connect(port)`."""

    role: str = ""

    def __init__(self, settings: Settings, in_port: int):
        self.settings = settings
        self.epoch = new_epoch()
        self.ctx = zmq.Context()
        self.receiver = Receiver(bind_pull(self.ctx, in_port), name=self.role)
        self.monitor = PeerMonitor(settings.heartbeat_interval)
        self.senders: list[Sender] = []
        self.stopping = False
        # Half an interval: a heartbeat is never more than 1.5 intervals late, well inside
        # the three intervals after which a peer is declared dead.
        self.idle_timeout_ms = max(1, int(settings.heartbeat_interval * 500))

    def connect(self, port: int) -> Sender:
        sender = Sender(connect_push(self.ctx, port), self.role, self.epoch, self.settings.heartbeat_interval)
        self.senders.append(sender)
        return sender

    # ----- what a service implements ----------------------------------------------------

    @abstractmethod
    def handle(self, msg: Message) -> None:
        """React to one message that is not a Hello or a Heartbeat."""

    def has_work(self) -> bool:
        """True while `step` has something to do: the loop then polls without waiting."""
        return False

    def step(self) -> None:
        """Compute between message batches (the worker's scheduler round)."""

    def on_peer_event(self, event: PeerEvent) -> None:
        """A peer came up, restarted or went silent (already logged)."""

    # ----- the loop ---------------------------------------------------------------------

    def serve_forever(self) -> None:
        """Run until SIGTERM or SIGINT, then close the sockets and return."""
        previous = {sig: signal.signal(sig, self._request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            for sender in self.senders:
                sender.hello()
            logger.info("%s serving (epoch %s)", self.role, self.epoch)
            while not self.stopping:
                self.run_once()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.close()
        logger.info("%s stopped", self.role)

    def run_once(self) -> None:
        timeout_ms = 0 if self.has_work() else self.idle_timeout_ms
        for msg in self.receiver.recv_all(timeout_ms, limit=RECV_BATCH_LIMIT):
            if self.monitor.accept(msg) and not isinstance(msg, (Hello, Heartbeat)):
                try:
                    self.handle(msg)
                except Exception:  # a message must never take the process down
                    logger.exception("dropped %s after an error handling it", type(msg).__name__)
        for event in self.monitor.poll():
            logger.info("peer %s %s (epoch %s)", event.peer, event.kind, event.epoch)
            self.on_peer_event(event)
        if self.has_work():
            self.step()
        for sender in self.senders:
            sender.heartbeat_if_due()

    def close(self) -> None:
        self.ctx.destroy(linger=100)

    def _request_stop(self, signum: int, frame: types.FrameType | None) -> None:
        logger.info("%s received %s; stopping", self.role, signal.Signals(signum).name)
        self.stopping = True


def run_service(service_cls: type[Service]) -> None:
    """`python -m services.<role>`: settings from flags and RADIXSERVE_* variables, logging,
    then the service's loop until SIGTERM/SIGINT."""
    settings = Settings.from_cli(prog=f"python -m services.{service_cls.role}")
    configure_logging(settings.log_level, service_cls.role)
    service_cls(settings).serve_forever()
