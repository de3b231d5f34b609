"""Starting the ranks of a tensor-parallel group on this node.

The calling process runs the node's first rank (on node 0: rank 0, the one that talks to
the other services); the node's other ranks are its children, spawned processes that each
join the group, build the same engine on their own device and follow rank 0. A child that
dies before the group has formed fails the start (`check`, called while the parent waits
for the ranks to join), naming the rank and its exit status. One that dies after leaves the
group unable to run a single collective, and a collective cannot be interrupted, so its
parent ends at once with a log line that names the rank, rather than waiting out the
group's timeout.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import signal
import socket
import threading
from collections.abc import Callable
from multiprocessing.process import BaseProcess

import torch
import torch.multiprocessing as mp

from engine.args import EngineArgs

logger = logging.getLogger(__name__)

RANK_DIED_EXIT_CODE = 4
"""Exit status of a process whose tensor-parallel child died (a crash exits 1)."""
JOIN_TIMEOUT_S = 30.0
"""How long a stopped group's children get to leave before they are killed."""

RankMain = Callable[[EngineArgs, int, str], None]
"""A child's body: (the engine's args, its global rank, the rendezvous host:port)."""


def dist_init_addr(args: EngineArgs) -> str:
    """The rendezvous: `--dist-init-addr`, or on one node 127.0.0.1 and a free port."""
    if args.dist_init_addr is not None:
        return args.dist_init_addr
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def rank_device(args: EngineArgs, rank: int) -> str:
    """The device of global `rank`: on CUDA the node's device of its local index."""
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.tp_size == 1 or not device.startswith("cuda"):
        return device
    local_rank = rank % args.ranks_per_node
    visible = torch.cuda.device_count()
    if args.ranks_per_node > visible:
        raise ValueError(
            f"tp_size {args.tp_size} over {args.nnodes} node(s) runs {args.ranks_per_node} "
            f"ranks on each, one per GPU, but this node sees {visible} GPU(s)"
        )
    return f"cuda:{local_rank}"


class RankProcesses:
    """This node's ranks after its first, as spawned children, watched by a thread."""

    def __init__(self, args: EngineArgs, addr: str, main: RankMain):
        first = args.first_rank
        rank_device(args, first)  # refuse a layout the node's devices cannot hold, first
        context = mp.get_context("spawn")
        self.procs: dict[int, BaseProcess] = {}
        for rank in range(first + 1, first + args.ranks_per_node):
            proc = context.Process(
                target=main, args=(args, rank, addr), name=f"tp-rank-{rank}", daemon=True
            )
            proc.start()
            self.procs[rank] = proc
            logger.info("started tensor-parallel rank %d (pid %d)", rank, proc.pid)
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._joined = False
        self.died: dict[int, int | None] = {}
        """Exit status of each child that exited before the group formed."""
        self.watcher = threading.Thread(target=self._watch, name="tp-ranks", daemon=True)
        self.watcher.start()

    def check(self) -> None:
        """Raise, naming it, if a child exited before the group formed: the start cannot
        succeed without it (called while waiting for the ranks to join)."""
        with self._lock:
            self._raise_if_died()

    def joined(self) -> None:
        """The group formed: from now on a child's death ends this process (`_die`)."""
        with self._lock:
            self._raise_if_died()
            self._joined = True

    def _raise_if_died(self) -> None:
        if self.died:
            rank, code = min(self.died.items())
            raise RuntimeError(
                f"tensor-parallel rank {rank} (pid {self.procs[rank].pid}) exited with "
                f"{_describe_exit(code)} before joining the group; see its log above"
            )

    def expect_exit(self) -> None:
        """The group is stopping: a child that exits now is not a death."""
        self.stopping.set()

    def join(self) -> None:
        """Wait for the children to leave (after rank 0 stopped them); kill stragglers.
        The watcher reaps them: it alone waits on them."""
        self.expect_exit()
        self.watcher.join(JOIN_TIMEOUT_S)
        if self.watcher.is_alive():
            logger.warning("tensor-parallel ranks did not stop in %g s; killing", JOIN_TIMEOUT_S)
            self.kill()

    def kill(self) -> None:
        """End the children now."""
        self.expect_exit()
        for proc in self.procs.values():
            proc.kill()
        self.watcher.join()

    def _watch(self) -> None:
        """Note a child that exits before the group formed (for `check`); end this process
        as soon as one dies after. A child that exits 0 once the group formed left because
        rank 0 stopped the group, as this process is about to."""
        waiting = {proc.sentinel: rank for rank, proc in self.procs.items()}
        while waiting:
            for sentinel in multiprocessing.connection.wait(list(waiting)):
                rank = waiting.pop(sentinel)  # type: ignore[arg-type]  # a sentinel is an int
                proc = self.procs[rank]
                proc.join()
                if not self.stopping.is_set():
                    with self._lock:
                        if not self._joined:
                            self.died[rank] = proc.exitcode
                        elif proc.exitcode != 0:
                            self._die(rank, proc)
                logger.info(
                    "tensor-parallel rank %d exited with %s", rank, _describe_exit(proc.exitcode)
                )

    def _die(self, rank: int, proc: BaseProcess) -> None:
        logger.critical(
            "tensor-parallel rank %d (pid %s) exited with %s; the group cannot go on "
            "without it, exiting",
            rank,
            proc.pid,
            _describe_exit(proc.exitcode),
        )
        logging.shutdown()
        os._exit(RANK_DIED_EXIT_CODE)


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"status {code}"


def configure_rank_logging(level: int, rank: int) -> None:
    """A spawned rank logs at its parent's level, tagged with its rank (a spawned process
    starts with logging unconfigured)."""
    logging.basicConfig(
        level=level, format=f"%(asctime)s tp-rank-{rank} %(levelname)s %(name)s: %(message)s"
    )
