"""A peer is dead on evidence that it stopped, never on one late heartbeat: silence past
the peer timeout, or silence of three intervals once its connections are gone (what a
process that exits leaves behind). `Connections` reads that from real sockets."""

from __future__ import annotations

import time

import zmq

from services.io_struct import Heartbeat
from services.ipc import Connections, PeerMonitor, bind_pull, bound_port, connect_push
from testing.net import wait_until

INTERVAL = 0.05


def beat(monitor: PeerMonitor, epoch: str = "e1") -> None:
    monitor.accept(Heartbeat(sender="worker", epoch=epoch))


def test_a_connected_peer_late_by_many_heartbeats_is_alive_until_the_peer_timeout():
    monitor = PeerMonitor(INTERVAL, timeout=20 * INTERVAL)
    beat(monitor)
    monitor.poll()
    time.sleep(6 * INTERVAL)  # twice the three misses that once meant death
    assert monitor.is_alive("worker") and monitor.poll() == []
    time.sleep(16 * INTERVAL)
    assert [(e.peer, e.kind) for e in monitor.poll()] == [("worker", "dead")]


def test_a_peer_without_connections_is_dead_after_three_missed_heartbeats():
    monitor = PeerMonitor(INTERVAL, timeout=100 * INTERVAL)
    beat(monitor)
    monitor.poll()
    monitor.connections(0)
    time.sleep(2 * INTERVAL)
    assert monitor.is_alive("worker")  # its last beats may still be on their way
    time.sleep(2 * INTERVAL)
    assert [(e.peer, e.kind) for e in monitor.poll()] == [("worker", "dead")]
    monitor.connections(1)  # a new life connects and beats: up again
    beat(monitor)
    assert [(e.peer, e.kind) for e in monitor.poll()] == [("worker", "up")]


def test_connections_names_only_its_peer():
    monitor = PeerMonitor(INTERVAL, timeout=100 * INTERVAL)
    beat(monitor)
    monitor.accept(Heartbeat(sender="detokenizer", epoch="d1"))
    monitor.poll()
    monitor.connections(0, "detokenizer")
    time.sleep(4 * INTERVAL)
    assert [(e.peer, e.kind) for e in monitor.poll()] == [("detokenizer", "dead")]


def test_connections_counts_peers_connecting_and_leaving_a_bound_socket():
    ctx = zmq.Context()
    pull = bind_pull(ctx, 0)
    connections = Connections(pull)
    try:
        assert connections.count() == 0
        first, second = (connect_push(ctx, bound_port(pull)) for _ in range(2))
        wait_until(lambda: connections.count() == 2, 5, "two connections")
        first.close(linger=0)
        wait_until(lambda: connections.count() == 1, 5, "one connection left")
        second.close(linger=0)
        wait_until(lambda: connections.count() == 0, 5, "none left")
    finally:
        connections.close()
        ctx.destroy(linger=0)
