"""`Outbox`: output batches survive a short disconnection, in order, and an absent peer
cannot make the sender hold messages without bound."""

from __future__ import annotations

import time

import zmq

from services.io_struct import AbortReq
from services.ipc import Outbox, Receiver, Sender, bind_pull, connect_push
from testing.net import free_port


def test_messages_for_an_absent_peer_are_held_and_arrive_in_order_once_it_binds():
    ctx = zmq.Context()
    try:
        port = free_port()
        outbox = Outbox(Sender(connect_push(ctx, port), "worker", "epoch-1"))
        for i in range(5):
            outbox.put(AbortReq(rid=f"r{i}"))
        assert len(outbox) == 5  # nobody listens yet: held, not dropped
        receiver = Receiver(bind_pull(ctx, port))
        deadline = time.monotonic() + 10
        while len(outbox):
            assert time.monotonic() < deadline, "the held messages were never sent"
            outbox.flush()
            time.sleep(0.01)
        received = []
        while len(received) < 5:
            assert time.monotonic() < deadline
            received += receiver.recv_all(100)
        assert [m.rid for m in received] == [f"r{i}" for i in range(5)]
        assert {(m.sender, m.epoch) for m in received} == {("worker", "epoch-1")}
    finally:
        ctx.destroy(linger=0)


def test_an_outbox_holds_at_most_max_held_dropping_the_oldest():
    ctx = zmq.Context()
    try:
        outbox = Outbox(Sender(connect_push(ctx, free_port()), "worker", "e"), max_held=3)
        for i in range(10):
            outbox.put(AbortReq(rid=f"r{i}"))
        assert [m.rid for m in outbox.held] == ["r7", "r8", "r9"]
    finally:
        ctx.destroy(linger=0)
