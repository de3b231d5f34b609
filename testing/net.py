"""Ports, polling and the HTTP probes that tests and benchmarks run against local servers."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx2

T = TypeVar("T")


def free_port() -> int:
    """A port free right now (the OS does not hand it out again at once)."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free right now: every socket stays bound until all are chosen, so
    no two of them can be the same port."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def wait_until(condition: Callable[[], T], timeout: float, what: str, interval: float = 0.1) -> T:
    """Poll `condition` until it is truthy (its value is returned); after `timeout` seconds,
    a failed assertion that names `what` was awaited."""
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(interval)
    return result


def http_status(url: str, timeout: float = 5.0) -> int | None:
    """The status of a GET, or None while nothing answers. Proxy variables are ignored: the
    servers probed are local."""
    try:
        return httpx2.get(url, timeout=timeout, trust_env=False).status_code
    except httpx2.TransportError:
        return None


def server_info(client: httpx2.Client, **params: str) -> dict[str, Any]:
    """radixserve's /get_server_info (`params` as its query, e.g. check_integrity="true");
    any other status than 200 is an error."""
    response = client.get("/get_server_info", params=params)
    if response.status_code != 200:
        raise AssertionError(f"/get_server_info answered {response.status_code}: {response.text}")
    return response.json()


def all_kv_free(client: httpx2.Client) -> bool:
    """Nothing running or waiting, and every KV slot free or evictable: what an idle server
    that leaked nothing reports."""
    info = server_info(client)
    return (
        info["num_running_reqs"] == 0
        and info["num_waiting_reqs"] == 0
        and info["protected_kv_tokens"] == 0
        and kv_whole(info)
    )


def kv_whole(info: dict[str, Any]) -> bool:
    """Every KV slot free or evictable, in each pool: a hybrid model's SWA pool too."""
    pools = {"": info["max_total_tokens"], "swa_": info.get("swa_max_total_tokens")}
    return all(
        info[f"{pool}available_kv_tokens"] + info[f"{pool}evictable_kv_tokens"] == total
        for pool, total in pools.items()
        if total is not None
    )


def assert_idle_and_whole(client: httpx2.Client) -> None:
    """Once no request is left running or waiting (within 30 s): every KV slot free or in
    the tree, and the tree whole (the worker's integrity check)."""

    def idle() -> dict[str, Any] | None:
        info = server_info(client, check_integrity="true")
        return info if info["num_running_reqs"] == info["num_waiting_reqs"] == 0 else None

    info = wait_until(idle, 30, "an idle worker")
    assert kv_whole(info), info
    assert info["radix_integrity"] == "ok"
