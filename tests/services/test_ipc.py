import asyncio
import logging
import socket
import time

import pytest
import zmq
import zmq.asyncio

from services.io_struct import (
    AbortReq,
    Heartbeat,
    Hello,
    TokenizedGenerateReqInput,
    encode,
    new_epoch,
)
from services.ipc import (
    AsyncReceiver,
    PeerEvent,
    PeerMonitor,
    Receiver,
    Sender,
    WireAuthenticator,
    WireKeys,
    bind_pull,
    bound_port,
    connect_push,
    create_wire_keys,
)


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def _send_when_connected(sender: Sender, msg, timeout: float = 5.0) -> None:
    """IMMEDIATE refuses sends until the TCP connection is up, which takes a few ms."""
    deadline = time.monotonic() + timeout
    while not sender.send(msg):
        assert time.monotonic() < deadline, "the PUSH socket never connected"
        time.sleep(0.005)


def _recv_one(receiver: Receiver, timeout: float = 5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        messages = receiver.recv_all(timeout_ms=50)
        if messages:
            assert len(messages) == 1, messages
            return messages[0]
    raise AssertionError("nothing arrived")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_pull_socket_binds_loopback_only(ctx):
    port = _free_port()
    sock = bind_pull(ctx, port)
    assert sock.getsockopt_string(zmq.LAST_ENDPOINT) == f"tcp://127.0.0.1:{port}"
    ephemeral = bind_pull(ctx, 0)
    assert (
        ephemeral.getsockopt_string(zmq.LAST_ENDPOINT) == f"tcp://127.0.0.1:{bound_port(ephemeral)}"
    )


def test_binding_a_taken_port_names_the_endpoint(ctx):
    taken = bind_pull(ctx, 0)
    port = bound_port(taken)
    with pytest.raises(OSError, match=f"cannot bind tcp://127.0.0.1:{port}"):
        bind_pull(ctx, port)


def test_push_socket_queues_only_for_a_connected_peer(ctx):
    port = _free_port()
    sock = connect_push(ctx, port)
    assert sock.getsockopt(zmq.IMMEDIATE) == 1
    assert sock.getsockopt_string(zmq.LAST_ENDPOINT) == f"tcp://127.0.0.1:{port}"


def test_sent_message_arrives_stamped_with_sender_and_epoch(ctx):
    pull = bind_pull(ctx, 0)
    epoch = new_epoch()
    sender = Sender(connect_push(ctx, bound_port(pull)), "tokenizer", epoch)
    request = TokenizedGenerateReqInput("r1", [1, 2, 3])
    _send_when_connected(sender, request)
    received = _recv_one(Receiver(pull))
    assert received.rid == "r1" and received.input_ids == [1, 2, 3]
    assert (received.sender, received.epoch) == ("tokenizer", epoch)
    assert request.sender == ""  # the caller's message is not mutated


def test_recv_all_drains_everything_queued(ctx):
    pull = bind_pull(ctx, 0)
    sender = Sender(connect_push(ctx, bound_port(pull)), "tokenizer", new_epoch())
    _send_when_connected(sender, AbortReq("r0"))
    for i in range(1, 20):
        assert sender.send(AbortReq(f"r{i}"))
    receiver = Receiver(pull)
    rids: list[str] = []
    deadline = time.monotonic() + 5
    while len(rids) < 20 and time.monotonic() < deadline:
        rids += [m.rid for m in receiver.recv_all(timeout_ms=50)]
    assert rids == [f"r{i}" for i in range(20)]
    assert receiver.recv_all(timeout_ms=0) == []


def test_malformed_messages_are_dropped_and_the_next_good_one_arrives(ctx, caplog):
    pull = bind_pull(ctx, 0)
    raw = ctx.socket(zmq.PUSH)
    raw.connect(f"tcp://127.0.0.1:{bound_port(pull)}")
    raw.send(b"\x93garbage")
    raw.send(b"\x81\xa4type\xa8ExecCode")  # a well-formed map of an unknown type
    raw.send(encode(AbortReq("r1"))[:-2])  # truncated
    raw.send_multipart([encode(AbortReq("r2")), b"extra frame"])
    raw.send(encode(AbortReq("good")))
    receiver = Receiver(pull, name="worker-in")
    with caplog.at_level(logging.WARNING, logger="services.ipc"):
        received = _recv_one(receiver)
    assert received.rid == "good"
    assert "worker-in: dropped 1 malformed message(s)" in caplog.text


def test_send_without_a_peer_returns_false_at_once(ctx, caplog):
    sender = Sender(connect_push(ctx, _free_port()), "tokenizer", new_epoch())
    with caplog.at_level(logging.WARNING, logger="services.ipc"):
        start = time.monotonic()
        results = [sender.send(AbortReq(f"r{i}")) for i in range(100)]
        elapsed = time.monotonic() - start
    assert not any(results)
    assert elapsed < 0.5
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert (
        len(warnings) == 1 and "peer not connected or send queue full" in warnings[0].getMessage()
    )


def test_liveness_messages_to_an_absent_peer_fail_quietly(ctx, caplog):
    sender = Sender(connect_push(ctx, _free_port()), "worker", new_epoch())
    with caplog.at_level(logging.WARNING, logger="services.ipc"):
        assert sender.hello() is False
        sender.heartbeat_if_due()
    assert caplog.records == []


def test_send_reports_a_full_queue_instead_of_blocking(ctx):
    pull = bind_pull(ctx, 0, hwm=1)  # bound, never read
    sender = Sender(connect_push(ctx, bound_port(pull), hwm=1), "tokenizer", new_epoch())
    big = TokenizedGenerateReqInput("r", list(range(200_000)))  # ~1 MB: fills kernel buffers fast
    _send_when_connected(sender, big)
    deadline = time.monotonic() + 10
    while True:
        start = time.monotonic()
        sent = sender.send(big)
        took = time.monotonic() - start
        if not sent:
            break
        assert time.monotonic() < deadline, "the send queue never filled"
    assert took < 0.1


def test_heartbeats_are_sent_once_per_interval(ctx):
    pull = bind_pull(ctx, 0)
    sender = Sender(
        connect_push(ctx, bound_port(pull)), "worker", new_epoch(), heartbeat_interval=0.2
    )
    _send_when_connected(sender, Hello())
    for _ in range(5):
        sender.heartbeat_if_due()  # only the first of these is due
    time.sleep(0.25)
    sender.heartbeat_if_due()
    receiver = Receiver(pull)
    received = []
    deadline = time.monotonic() + 2
    while len(received) < 3 and time.monotonic() < deadline:
        received += receiver.recv_all(timeout_ms=50)
    time.sleep(0.05)
    received += receiver.recv_all(timeout_ms=0)
    assert [type(m) for m in received] == [Hello, Heartbeat, Heartbeat]


def test_sender_refuses_an_asyncio_socket():
    actx = zmq.asyncio.Context()
    sock = actx.socket(zmq.PUSH)
    try:
        with pytest.raises(TypeError, match="plain zmq socket"):
            Sender(sock, "tokenizer", new_epoch())
    finally:
        sock.close(linger=0)
        actx.term()


def test_async_receiver_skips_bad_bytes_and_returns_the_next_message(ctx):
    async def scenario() -> AbortReq:
        actx = zmq.asyncio.Context()
        pull = bind_pull(actx, 0)
        try:
            raw = ctx.socket(zmq.PUSH)
            raw.connect(f"tcp://127.0.0.1:{bound_port(pull)}")
            raw.send(b"\xff\x00junk")
            raw.send(encode(AbortReq("after-junk")))
            return await asyncio.wait_for(AsyncReceiver(pull).recv(), timeout=5)
        finally:
            pull.close(linger=0)
            actx.term()

    assert asyncio.run(scenario()).rid == "after-junk"


# ----- PeerMonitor ------------------------------------------------------------------------

INTERVAL = 0.1


def test_peer_is_alive_until_three_heartbeats_are_missed():
    monitor = PeerMonitor(interval=INTERVAL)
    epoch = new_epoch()
    assert not monitor.is_alive("worker")
    assert monitor.accept(Hello(sender="worker", epoch=epoch))
    assert monitor.poll() == [PeerEvent("worker", "up", epoch)]
    for _ in range(4):  # heartbeats on time keep it alive well past 3 intervals
        time.sleep(INTERVAL)
        assert monitor.accept(Heartbeat(sender="worker", epoch=epoch))
        assert monitor.is_alive("worker")
    assert monitor.poll() == []
    time.sleep(2 * INTERVAL)
    assert monitor.is_alive("worker")  # two missed: not yet
    time.sleep(1.5 * INTERVAL)
    assert not monitor.is_alive("worker")
    assert monitor.poll() == [PeerEvent("worker", "dead", epoch)]
    assert monitor.poll() == []  # reported once
    assert monitor.accept(Heartbeat(sender="worker", epoch=epoch))  # it was only stalled
    assert monitor.is_alive("worker")
    assert monitor.poll() == [PeerEvent("worker", "up", epoch)]


def test_new_epoch_is_a_restart_and_the_old_epoch_is_rejected():
    monitor = PeerMonitor(interval=INTERVAL)
    old, new = new_epoch(), new_epoch()
    assert monitor.accept(Hello(sender="worker", epoch=old))
    assert monitor.accept(AbortReq("r1", sender="worker", epoch=old))
    assert monitor.accept(Hello(sender="worker", epoch=new))
    assert monitor.epoch("worker") == new
    assert monitor.poll() == [PeerEvent("worker", "up", old), PeerEvent("worker", "restart", new)]
    assert not monitor.accept(AbortReq("r1", sender="worker", epoch=old))
    assert not monitor.accept(
        Heartbeat(sender="worker", epoch=old)
    )  # a late heartbeat cannot revive it
    assert monitor.epoch("worker") == new
    assert monitor.accept(AbortReq("r2", sender="worker", epoch=new))
    assert monitor.poll() == []


def test_first_message_of_a_new_life_need_not_be_a_hello():
    monitor = PeerMonitor(interval=INTERVAL)
    old, new = new_epoch(), new_epoch()
    monitor.accept(Heartbeat(sender="detokenizer", epoch=old))
    assert monitor.accept(AbortReq("r1", sender="detokenizer", epoch=new))
    assert monitor.poll()[-1] == PeerEvent("detokenizer", "restart", new)
    assert not monitor.accept(Heartbeat(sender="detokenizer", epoch=old))


def test_peers_are_tracked_separately_and_unstamped_messages_pass():
    monitor = PeerMonitor(interval=INTERVAL)
    monitor.accept(Hello(sender="worker", epoch="w1"))
    monitor.accept(Hello(sender="detokenizer", epoch="d1"))
    assert monitor.accept(AbortReq("r1"))
    time.sleep(2 * INTERVAL)
    monitor.accept(Heartbeat(sender="worker", epoch="w1"))
    time.sleep(1.5 * INTERVAL)
    assert monitor.is_alive("worker") and not monitor.is_alive("detokenizer")
    assert monitor.epoch("tokenizer") is None


def test_monitor_sees_a_restart_across_real_sockets(ctx):
    """Two lives of one peer on one PULL socket: once the new life is heard from, the old
    life's messages still in flight are rejected."""
    pull = bind_pull(ctx, 0)
    port = bound_port(pull)
    receiver, monitor = Receiver(pull), PeerMonitor(interval=INTERVAL)
    old = Sender(connect_push(ctx, port), "worker", new_epoch())
    _send_when_connected(old, Hello())
    assert monitor.accept(_recv_one(receiver))
    new = Sender(connect_push(ctx, port), "worker", new_epoch())
    _send_when_connected(new, Hello())
    assert monitor.accept(_recv_one(receiver))
    assert monitor.poll()[-1] == PeerEvent("worker", "restart", new.epoch)
    assert old.send(AbortReq("stale")) and new.send(AbortReq("fresh"))
    received = []
    deadline = time.monotonic() + 5
    while len(received) < 2 and time.monotonic() < deadline:
        received += receiver.recv_all(timeout_ms=50)
    assert sorted(m.rid for m in received) == ["fresh", "stale"]
    assert [m.rid for m in received if monitor.accept(m)] == ["fresh"]


# ----- the authenticated wire ---------------------------------------------------------------


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_curve_with_the_pods_keys_delivers_and_an_unknown_key_or_plain_zmq_never_does(
    tmp_path, transport
):
    """Over loopback TCP (the chart's explicit ports) and ipc:// (radixserve serve's default)."""
    keys_dir = create_wire_keys(tmp_path / "keys")
    worker, tokenizer = (WireKeys.load(keys_dir, role) for role in ("worker", "tokenizer"))
    stranger = WireKeys.load(create_wire_keys(tmp_path / "other"), "tokenizer")
    # It knows the server's public key (public keys are no secret), not a pod's client key.
    stranger = WireKeys("tokenizer", stranger.public, stranger.secret, worker.publics)
    server_ctx, client_ctx = zmq.Context(), zmq.Context()
    WireAuthenticator(server_ctx, worker).start()
    pull = bind_pull(server_ctx, 0 if transport == "tcp" else f"ipc://{tmp_path}/w", keys=worker)
    port = bound_port(pull) if transport == "tcp" else f"ipc://{tmp_path}/w"
    receiver = Receiver(pull)
    try:
        strangers = [
            Sender(connect_push(client_ctx, port), "tokenizer", new_epoch()),
            Sender(
                connect_push(client_ctx, port, keys=stranger, server="worker"),
                "tokenizer",
                new_epoch(),
            ),
        ]
        member = Sender(
            connect_push(client_ctx, port, keys=tokenizer, server="worker"),
            "tokenizer",
            new_epoch(),
        )
        _send_when_connected(member, AbortReq(rid="from the pod"))
        assert _recv_one(receiver).rid == "from the pod"
        for sender in strangers:  # IMMEDIATE: refused, as their handshake never completes
            assert not sender.send(AbortReq(rid="spoofed"))
        assert receiver.recv_all(timeout_ms=300) == []
    finally:
        client_ctx.destroy(linger=0)
        server_ctx.destroy(linger=0)  # ends the authenticator's thread: no hang here


def test_a_curve_server_without_an_authenticator_admits_nobody(tmp_path):
    """ZAP is enforced: a forgotten authenticator fails closed, not open."""
    keys_dir = create_wire_keys(tmp_path / "keys")
    server_ctx, client_ctx = zmq.Context(), zmq.Context()
    pull = bind_pull(server_ctx, 0, keys=WireKeys.load(keys_dir, "worker"))
    keys = WireKeys.load(keys_dir, "tokenizer")
    push = connect_push(client_ctx, bound_port(pull), keys=keys, server="worker")
    try:
        assert not push.poll(500, zmq.POLLOUT)
    finally:
        client_ctx.destroy(linger=0)
        server_ctx.destroy(linger=0)


# ----- ipc:// endpoints (radixserve serve's default) ------------------------------------------


def test_an_ipc_socket_in_use_is_refused_and_a_stale_one_replaced(ctx, tmp_path):
    live = f"ipc://{tmp_path}/live"
    listening = bind_pull(ctx, live)
    # zmq would replace the file and silently cut the first socket off.
    with pytest.raises(OSError, match=f"cannot bind {live}: a socket already listens on it"):
        bind_pull(ctx, live)
    assert not listening.closed
    stale = tmp_path / "stale"
    with socket.socket(socket.AF_UNIX) as left_behind:  # bound, never listening, then gone
        left_behind.bind(str(stale))
    assert stale.exists()
    receiver = Receiver(bind_pull(ctx, f"ipc://{stale}"))
    _send_when_connected(
        Sender(connect_push(ctx, f"ipc://{stale}"), "tokenizer", new_epoch()), AbortReq("r1")
    )
    assert _recv_one(receiver).rid == "r1"
