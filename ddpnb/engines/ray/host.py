"""A node's host, on the Ray cluster: one actor per node, owned by the kernel, that keeps a warm forkserver and
forks each launch's ranks on its node from it (`node.forked`, as the local engine does in the kernel), then relays
what they send to the kernel, which long-polls `drain`.

Ranks forked here are not Ray workers: the run's placement group holds their CPUs and GPUs, and the host hands
them what Ray would (their node's environment, their GPUs, the notebook data, fetched from the object store once
per node into memory files each rank maps copy-on-write).
"""

from __future__ import annotations

import mmap
import os
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from ddpnb.core.spec import Stream
from ddpnb.engines.ray import version_warning
from ddpnb.node import forkserver
from ddpnb.node.forked import ForkedRanks, bind_store_socket
from ddpnb.node.rank import Seat
from ddpnb.node.relay import Event, Relay

RECENT_COMMANDS = 4  # commands whose data's memory files stay open (the kernel keeps as many: data.KEEP_LAUNCHES)
READER_WAIT = 10.0  # seconds `close` waits for the ranks' reader to see them all end before closing their pipes
TURN_WAIT = 30.0  # seconds a command waits for the one the kernel sent before it (lost with a failed call)


@dataclass
class HostedRun:
    """One run's ranks on this node."""

    ranks: ForkedRanks
    relay: Relay
    scratch: str  # the ranks' stack files
    files: dict[str, int] = field(default_factory=dict)  # object id -> the memory file holding its bytes
    commands: list[list[str]] = field(default_factory=list)  # the object ids each recent command used
    turn: threading.Condition = field(default_factory=threading.Condition)
    next_command: int = 0  # the number of the kernel's next command or interrupt (`in_turn`)
    closed: bool = False  # `close` came (under `turn`): nothing is forked, sent or fetched any more
    reader: threading.Thread | None = None

    def in_turn(self, number: int, call: Any) -> None:
        """Calls from the kernel in the order it made them: this threaded actor may start them in either."""
        with self.turn:
            self.turn.wait_for(lambda: self.next_command >= number or self.closed, timeout=TURN_WAIT)
            try:
                if not self.closed:
                    call()
            finally:
                self.next_command = max(self.next_command, number + 1)
                self.turn.notify_all()


class Host:
    """A node's host actor (0 CPUs; threaded: each run's drain long-polls while the kernel calls in)."""

    def __init__(self) -> None:
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        self.ip = ray.util.get_node_ip_address()
        self._runs: dict[str, HostedRun] = {}
        self._stores: dict[str, socket.socket] = {}
        forkserver.warm_up_in_background()  # `import torch` once per node, while the kernel places the run

    def where(self) -> tuple[str, str, int]:
        return self.node_id, self.ip, os.getpid()

    def bind_store(self, run: str, loopback: bool) -> int:
        """Rank 0's TCPStore socket, on this node (loopback: every rank is here): its port, for every seat."""
        sock = bind_store_socket("127.0.0.1" if loopback else self.ip)
        self._stores[run] = sock
        return sock.getsockname()[1]

    def start(
        self,
        run: str,
        spec_payload: bytes,
        seats: list[Seat],
        refs: dict[int, Any],
        commands: bool,
        preloaded: list[str],
        kernel_versions: dict[str, str],
    ) -> list[str]:
        """Fork this node's ranks of `run`; returns notes for the kernel to print (a preload that failed here)."""
        notes = _preload(preloaded, busy=lambda: bool(self._runs))
        scratch = tempfile.mkdtemp(prefix="ddpnb-ray-")
        environ = dict(os.environ)  # the node's own environment, as a Ray worker's would be
        seats = [replace(seat, stack_dir=scratch, environ={**environ, **seat.environ}) for seat in seats]
        relay = Relay()
        hosted = HostedRun(ForkedRanks(seats), relay, scratch)
        self._runs[run] = hosted
        if warning := version_warning(kernel_versions):
            for seat in seats:
                relay.output(seat.rank, Stream.STDERR, f"{warning}\n".encode())
        # under `turn`: a `close` that comes meanwhile (the kernel gave up waiting) waits, then finds them forked
        with hosted.turn:
            if hosted.closed:
                return notes
            data = self._files(hosted, refs)
            with forkserver.lock:  # `preload` must not restart the forkserver while ranks are forked from it
                hosted.ranks.start(
                    relay, forkserver.context_held(), spec_payload, data, self._stores.pop(run, None), None, commands
                )
            hosted.reader = threading.Thread(target=self._serve, args=(hosted,), name=f"ddpnb-host-{run}", daemon=True)
            hosted.reader.start()
        return notes

    def _serve(self, hosted: HostedRun) -> None:
        try:
            hosted.ranks.serve()
        finally:
            hosted.relay.finish()

    def drain(self, run: str, wait: float) -> tuple[list[Event], bool]:
        hosted = self._runs.get(run)
        if hosted is None:
            return [], True
        return hosted.relay.take(wait)

    def stop(self, run: str, ranks: list[int]) -> None:
        if (hosted := self._runs.get(run)) is not None:
            hosted.ranks.stop(ranks)

    def escalate(self, run: str) -> None:
        if (hosted := self._runs.get(run)) is not None:
            hosted.ranks.escalate()

    def collect_stacks(self, run: str, ranks: list[int]) -> dict[int, str]:
        hosted = self._runs.get(run)
        return hosted.ranks.collect_stacks(ranks) if hosted is not None else {}

    def send(self, run: str, number: int, ranks: list[int], command: bytes, refs: dict[int, Any]) -> None:
        """A session command, with the notebook data it refers to mapped by each rank from this host's files."""
        if (hosted := self._runs.get(run)) is None:
            return

        def deliver() -> None:
            hosted.relay.commanded = time.monotonic()
            hosted.ranks.send(ranks, command, self._files(hosted, refs))

        hosted.in_turn(number, deliver)

    def interrupt(self, run: str, number: int, ranks: list[int]) -> None:
        if (hosted := self._runs.get(run)) is not None:
            hosted.in_turn(number, lambda: hosted.ranks.interrupt(ranks))

    def close(self, run: str) -> None:
        sock = self._stores.pop(run, None)
        if sock is not None:
            sock.close()
        hosted = self._runs.get(run)
        if hosted is None:
            return
        with hosted.turn:  # after a `start` or command in progress; none after this
            hosted.closed = True
            hosted.turn.notify_all()
        hosted.relay.abandon()  # its reader waits for no drain now
        hosted.ranks.escalate()  # whatever still runs: SIGKILL, so the reader sees every rank end
        if hosted.reader is not None:
            hosted.reader.join(READER_WAIT)
        hosted.ranks.close()
        for fd in hosted.files.values():
            os.close(fd)
        hosted.files.clear()
        shutil.rmtree(hosted.scratch, ignore_errors=True)
        self._runs.pop(run, None)

    def _files(self, hosted: HostedRun, refs: dict[int, Any]) -> dict[int, tuple[int, ...]]:
        """The objects `refs` name, each fetched once into a memory file (reused while it stays in the latest
        commands' data); the files of objects no recent command used are closed (ranks mapped them already)."""
        import ray

        if not refs:  # a command without data (a debugger's answer, STOP) keeps what earlier ones mapped
            return {}
        wanted = [ref for ref in refs.values() if ref.hex() not in hosted.files]
        for ref, value in zip(wanted, ray.get(wanted), strict=True):
            hosted.files[ref.hex()] = _memory_file(value)
        hosted.commands = [*hosted.commands, [ref.hex() for ref in refs.values()]][-RECENT_COMMANDS:]
        recent = {name for used in hosted.commands for name in used}
        for name in [name for name in hosted.files if name not in recent]:
            os.close(hosted.files.pop(name))
        return {key: (hosted.files[ref.hex()],) for key, ref in refs.items()}


def _memory_file(array: Any) -> int:
    """A memory file holding a flat uint8 array's bytes (the object store's read-only copy, mapped in place)."""
    fd = os.memfd_create("ddpnb-ray-data", os.MFD_CLOEXEC)
    os.ftruncate(fd, array.nbytes)
    with mmap.mmap(fd, array.nbytes) as mapping:
        mapping[:] = memoryview(array).cast("B")
    return fd


def _preload(modules: list[str], busy: Any) -> list[str]:
    """The kernel's `ddpnb.preload` list, applied to this node's forkserver where it differs."""
    missing = [name for name in modules if name not in forkserver.preloaded()]
    if not missing:
        return []
    try:
        forkserver.preload(dict.fromkeys(missing), busy=busy)
    except forkserver.PreloadError as exc:
        return [f"[ddpnb] on this Ray node: {exc}"]
    return []
