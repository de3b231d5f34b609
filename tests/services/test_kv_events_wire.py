"""KV-cache events on the wire: the publisher's framing, replay and back-pressure, and a
real server publishing what its tree holds to a subscriber on 127.0.0.1."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx2
import pytest
import zmq

from engine.api import Engine
from engine.cache.kv_events import (
    AllBlocksCleared,
    BlockEventRecorder,
    BlockRemoved,
    block_hashes,
)
from engine.cache.namespace import PrefixNamespace
from engine.sampling.sampling_params import SamplingParams
from engine.sched.req import Admission, Req
from services.kv_events_config import KVEventsConfig
from services.worker.kv_event_publisher import ZmqEventPublisher
from testing.kv_events import Subscriber
from testing.net import free_ports, wait_until
from testing.radix import tree_blocks
from tests.services.conftest import RouterFacingServer

BLOCK = 16


def loopback(port: int) -> str:
    return f"tcp://127.0.0.1:{port}"


@pytest.fixture
def publisher_and_subscriber() -> Iterator[tuple[ZmqEventPublisher, Subscriber]]:
    pub_port, replay_port = free_ports(2)
    config = KVEventsConfig(
        publisher="zmq",
        endpoint=loopback(pub_port),
        replay_endpoint=loopback(replay_port),
        topic="kv",
        buffer_steps=4,
    )
    publisher = ZmqEventPublisher(config)
    subscriber = Subscriber(loopback(pub_port), "kv", loopback(replay_port))
    yield publisher, subscriber
    subscriber.close()
    publisher.close()


def removed(i: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=[i], medium="GPU")


def test_batches_go_out_as_topic_seq_payload_and_replay_returns_the_buffered_tail(
    publisher_and_subscriber,
):
    publisher, subscriber = publisher_and_subscriber
    wait_until(  # a SUB socket misses what is sent before it has joined
        lambda: publisher.publish([AllBlocksCleared()]) or subscriber.drain(0.1),
        10,
        "the subscriber to join",
    )
    first = subscriber.batches[-1][0] + 1
    subscriber.batches.clear()
    for i in range(6):
        publisher.publish([removed(i)])
    wait_until(lambda: subscriber.drain(0.1) == 0 and len(subscriber.batches) == 6, 10, "six")
    assert [seq for seq, _ in subscriber.batches] == list(range(first, first + 6))
    assert [events for _, events in subscriber.batches] == [
        [["BlockRemoved", [i], "GPU"]] for i in range(6)
    ]
    # The buffer keeps the last 4; asking from before them returns what is left, in order.
    assert subscriber.replay(first) == subscriber.batches[2:]
    assert subscriber.replay(first + 5) == subscriber.batches[5:]
    assert subscriber.replay(first + 6) == []


def test_a_full_queue_drops_and_counts_instead_of_blocking():
    (port,) = free_ports(1)
    config = KVEventsConfig(publisher="zmq", endpoint=loopback(port), max_queue_size=1)
    publisher = ZmqEventPublisher(config)
    try:
        for i in range(2000):
            publisher.publish([removed(i)])
        assert publisher.dropped > 0
        wait_until(lambda: publisher.published + publisher.dropped == 2000, 10, "all accounted")
    finally:
        publisher.close()


def test_a_subscriber_that_never_reads_loses_batches_and_the_publisher_never_waits():
    (port,) = free_ports(1)
    config = KVEventsConfig(publisher="zmq", endpoint=loopback(port), hwm=1)
    publisher = ZmqEventPublisher(config)
    context = zmq.Context()
    stuck = context.socket(zmq.SUB)
    stuck.setsockopt(zmq.RCVHWM, 1)
    stuck.setsockopt(zmq.RCVBUF, 4096)
    stuck.setsockopt_string(zmq.SUBSCRIBE, "")
    stuck.connect(loopback(port))
    try:
        big = BlockRemoved(block_hashes=list(range(2**40, 2**40 + 100_000)), medium="GPU")
        time.sleep(0.3)  # joined
        for _ in range(200):  # ~180 MB if every batch were kept
            publisher.publish([big])
        wait_until(lambda: publisher.published == 200, 60, "all sent")
        received = 0
        while stuck.poll(500):
            stuck.recv_multipart()
            received += 1
        assert received < 200  # the rest were dropped at its high-water mark
    finally:
        context.destroy(linger=0)
        publisher.close()


@pytest.mark.parametrize(
    "config",
    ['{"publisher": "zmq", "endpiont": "tcp://*:1"}', '{"publisher": "kafka"}', "{", "[1]"],
)
def test_a_bad_config_is_refused_naming_the_flag(config: str):
    with pytest.raises(ValueError, match="--kv-events-config"):
        KVEventsConfig.from_json(config)


# ----- the scheduler through the publisher ------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True])
def test_the_subscribed_blocks_equal_the_tree_after_every_turn_through_retraction_and_flush(
    tiny_model_dir: Path, publisher_and_subscriber, overlap: bool
):
    """The engine's scheduler on a pool small enough to evict and retract, its events sent
    through the real publisher each turn, as the worker does: what the subscriber on
    127.0.0.1 has decoded equals the RadixCache's full 16-token blocks after every turn."""
    publisher, subscriber = publisher_and_subscriber
    engine = Engine(
        str(tiny_model_dir),
        dtype="float64",
        device="cpu",
        skip_tokenizer_init=True,
        max_total_tokens=600,
        chunked_prefill_size=48,
        max_running_requests=12,
        disable_overlap_schedule=not overlap,
    )
    scheduler = engine.scheduler
    tree = scheduler.cache_manager.tree_cache
    recorder = BlockEventRecorder(BLOCK)
    tree.attach_kv_events(recorder)
    startup = recorder.take()
    wait_until(  # the start-up AllBlocksCleared, resent until the subscriber has joined
        lambda: publisher.publish(startup) or subscriber.drain(0.1), 10, "the subscriber"
    )
    rng = random.Random(3)

    def tokens(n: int) -> list[int]:  # the tiny model's vocabulary is 256
        return [rng.randrange(3, 256) for _ in range(n)]

    prefixes = [tokens(40) for _ in range(3)]
    for i in range(18):
        scheduler.add_request(
            Req(
                f"r{i}",
                prefixes[i % 3] + tokens(rng.randint(5, 30)),
                SamplingParams(max_new_tokens=48, temperature=0, ignore_eos=True),
                admission=Admission(
                    extra_key=PrefixNamespace(cache_salt="tenant-a") if i % 2 else None
                ),
            )
        )
    turns = 0

    def after_turn(_outputs: list[Req]) -> None:
        nonlocal turns
        events = recorder.take()
        if events:
            publisher.publish(events)
            wait_until(lambda: subscriber.drain(0.01), 10, "the turn's batch")
        assert subscriber.blocks == tree_blocks(tree, BLOCK), f"turn {turns}"
        turns += 1

    try:
        scheduler.run_event_loop(lambda: not scheduler.has_work(), send_outputs=after_turn)
        scheduler.run_event_loop(lambda: scheduler.in_flight is None, send_outputs=after_turn)
        assert scheduler.stats.num_retractions > 0 and tree.evicted_tokens > 0
        assert subscriber.blocks and turns > 10
        stored = [e for _, events in subscriber.batches for e in events if e[0] == "BlockStored"]
        salted = [e for e in stored if e[8] is not None]
        assert salted and all(e[8][0] == [["cache_salt", "tenant-a"]] for e in salted)

        scheduler.cache_manager.reset()  # what /flush_cache does
        after_turn([])
        assert subscriber.batches[-1][1] == [["AllBlocksCleared"]] and not subscriber.blocks
    finally:
        engine.shutdown()


# ----- a real server --------------------------------------------------------------------


@dataclass
class Server:
    client: httpx2.Client
    model: str
    subscriber: Subscriber
    events_endpoint: str
    worker_metrics: str


@pytest.fixture(scope="module")
def server(router_facing_server: RouterFacingServer) -> Iterator[Server]:
    """The shared server with a subscriber joined and the tree empty: a flush publishes
    `AllBlocksCleared`, repeated until the subscriber has seen one."""
    shared = router_facing_server
    subscriber = Subscriber(shared.events_endpoint, "kv@rs", shared.replay_endpoint)
    with httpx2.Client(base_url=shared.url, timeout=120) as client:
        wait_until(
            lambda: client.post("/flush_cache").status_code == 200 and subscriber.drain(0.2),
            30,
            "the subscriber to join",
        )
        worker_metrics = f"http://127.0.0.1:{shared.ports['worker-metrics-port']}/metrics"
        yield Server(client, shared.model, subscriber, shared.events_endpoint, worker_metrics)
    subscriber.close()


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, 40_000) for _ in range(n)]


def settle(subscriber: Subscriber) -> None:
    """Take in every batch sent so far (the worker publishes at the end of each turn)."""
    subscriber.drain(0.5)


def test_a_server_publishes_its_tree_blocks_salts_flushes_and_replays(server):
    client, subscriber = server.client, server.subscriber
    # The start-up AllBlocksCleared went out before anyone subscribed: replay has it.
    assert subscriber.replay(0)[0] == (0, [["AllBlocksCleared"]])
    assert not subscriber.blocks  # the fixture's flush

    plain = prompt(1, 50)
    reply = client.post(
        "/generate", json={"input_ids": plain, "sampling_params": {"max_new_tokens": 1}}
    )
    assert reply.status_code == 200, reply.text
    wait_until(lambda: settle(subscriber) or subscriber.blocks, 10, "the first blocks")
    assert subscriber.blocks == set(block_hashes(plain, None))  # 3 blocks; 2 tokens left over

    salted = plain[:40] + prompt(2, 30)
    reply = client.post(
        "/v1/completions",
        json={"model": server.model, "prompt": salted, "max_tokens": 1, "cache_salt": "tenant-a"},
    )
    assert reply.status_code == 200, reply.text
    salt = PrefixNamespace(cache_salt="tenant-a")
    expected = set(block_hashes(plain, None)) | set(block_hashes(salted, salt))
    wait_until(lambda: settle(subscriber) or subscriber.blocks == expected, 10, "salted blocks")
    stored = [e for _, events in subscriber.batches for e in events if e[0] == "BlockStored"]
    assert stored[-1][8] == [[["cache_salt", "tenant-a"]]] * 4  # 70 tokens: 4 full blocks
    assert stored[-1][2] is None  # a salted chain shares no parent with the plain one

    reply = client.post("/flush_cache")
    assert reply.status_code == 200, reply.text
    wait_until(lambda: settle(subscriber) or not subscriber.blocks, 10, "the flush")
    assert subscriber.batches[-1][1] == [["AllBlocksCleared"]]

    # A subscriber that missed batches gets the same ones back, in order.
    seen = subscriber.batches
    assert subscriber.replay(seen[0][0]) == seen


def test_a_subscriber_that_never_reads_does_not_stall_decoding(server):
    client = server.client
    context = zmq.Context()
    stuck = context.socket(zmq.SUB)
    stuck.setsockopt(zmq.RCVHWM, 1)
    stuck.setsockopt_string(zmq.SUBSCRIBE, "")
    stuck.connect(server.events_endpoint)
    try:
        body = {
            "input_ids": [prompt(10 + i, 40) for i in range(12)],
            "sampling_params": {"max_new_tokens": 24, "ignore_eos": True},
        }
        reply = client.post("/generate", json=body)
        assert reply.status_code == 200, reply.text
        assert all(len(r["output_ids"]) == 24 for r in reply.json())
    finally:
        context.destroy(linger=0)
    metrics = httpx2.get(server.worker_metrics).text
    published = next(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("radixserve_kv_events_published_batches_total")
    )
    assert published > 0


def test_without_an_endpoint_the_publisher_binds_loopback_only():
    config = KVEventsConfig.from_json('{"publisher": "zmq"}')
    assert config.enabled and config.endpoint == "tcp://127.0.0.1:5557"
