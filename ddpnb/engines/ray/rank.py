"""A rank on a Ray Train worker: fds captured, messages batched to the run actor, commands long-polled from it."""

from __future__ import annotations

import fcntl
import os
import signal
import struct
import sys
import termios
import threading
import time
from pathlib import Path
from typing import Any

from ddpnb import _compat
from ddpnb.core import messages as msg
from ddpnb.core.messages import Output, Placed, Stacks
from ddpnb.core.spec import WorkerSpec
from ddpnb.core.stacks import thread_stack
from ddpnb.engines.ray import fetched, version_warning
from ddpnb.rank import context as ctx
from ddpnb.rank import group
from ddpnb.rank.main import run_function

SEND_INTERVAL = 0.05  # a rank batches what it sends for this long: one actor call, not one per line or metric
COMMAND_POLL = 30.0  # seconds a rank's long poll for commands (send your stacks) waits in the run actor
CLOSE_WAIT = 10.0  # seconds a finished rank waits for its last messages to reach the run actor


class RankFailed(RuntimeError):
    """Raised to Ray Train so it stops the other ranks; the rank's own traceback already went to the notebook."""


def rank_main(config: dict[str, Any]) -> None:
    """Ray Train's `train_loop_per_worker`: one rank of a ddpnb run."""
    import ray
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    channel = config["channel"]
    restarts = ray.get(channel.join.remote(rank))  # Ray Train's restarts of the workers so far (FailureConfig)
    link = _Link(rank, channel)
    runtime = ray.get_runtime_context()
    link.send(
        Placed(
            rank=rank,
            node_id=runtime.get_node_id(),
            node_ip=ray.util.get_node_ip_address(),
            pid=os.getpid(),
            placement_group=ray.util.get_current_placement_group(),
        )
    )
    finished = threading.Event()
    threading.Thread(
        target=_serve_commands,
        args=(link, channel, finished, threading.get_ident()),
        name="ddpnb-commands",
        daemon=True,
    ).start()
    capture = _Capture(link)
    # Ray's workers import for themselves: `ddpnb.preload` does not apply, so rank 0 does not suggest it
    context = ctx.RankContext(
        rank=rank,
        link=link,
        suggests_preload=False,
        checkpoints=_RayCheckpoints() if config.get("report_checkpoints") else None,
    )

    def setup(rank: int, spec: WorkerSpec) -> str:
        spec.attempt += restarts  # the kernel's attempts so far, then Ray Train's within this fit
        return _setup_on_ray(rank, spec)

    try:
        _warn_about_versions(config["versions"])
        fetched.receive(config.get("data") or {})  # before the spec, whose function and args refer to them
        run_function(context, config["spec"], setup=setup, join_group=_join_ray_group)
        # Ray Train's workers outlive the rank: take its group down, so that a peer left in a collective this rank
        # never joins (one all_reduce too many) fails now (gloo) instead of waiting for the group's timeout
        group.destroy_process_group()
    except SystemExit:  # the rank failed and said so (`run_function`): Ray Train must now stop the others
        raise RankFailed(f"rank {rank} failed; its traceback is in the notebook") from None
    finally:
        finished.set()
        capture.close()
        link.close()
        ctx.enter(None)


def _setup_on_ray(rank: int, spec: WorkerSpec) -> str:
    """The rank's environment and device. Ray Train set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ... already;
    the node keeps its own environment, plus the run's --env values."""
    import ray.train.torch
    import torch

    os.environ.update(spec.environ)
    os.environ["DDPNB_WORKER"] = "1"
    device = ray.train.torch.get_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        return str(device)
    return "cpu"


def _join_ray_group(context: ctx.RankContext, spec: WorkerSpec) -> None:
    """Ray Train formed the process group; a call to `init_process_group` for another backend reuses its store."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("Ray Train did not initialise the torch process group")
    context.store = _compat.default_store()


class _RayCheckpoints:
    """ddpnb's checkpoints registered with Ray Train, whose storage is the run's checkpoint directory: every rank
    reports each complete one (`ray.train.report` is a barrier Ray Train needs every worker at), and after Ray
    Train restarted the workers `ray.train.get_checkpoint()` names the latest."""

    def __init__(self) -> None:
        import logging

        _compat.ray_report_logger().setLevel(logging.WARNING)  # not a line in the rank's output per report

    def saved(self, step: int, path: Path) -> None:
        import ray.train

        first = ray.train.get_context().get_world_rank() == 0
        # the directory is already in Ray Train's storage (DCP wrote it there): registered, not copied
        ray.train.report(
            {"step": step},
            checkpoint=ray.train.Checkpoint(str(path)) if first else None,
            checkpoint_upload_mode=ray.train.CheckpointUploadMode.NO_UPLOAD,
        )

    def latest(self) -> Path | None:
        import ray.train

        checkpoint = ray.train.get_checkpoint()
        return Path(checkpoint.path) if checkpoint is not None else None


def _warn_about_versions(kernel: dict[str, str]) -> None:
    if warning := version_warning(kernel):
        print(warning, file=sys.stderr)


class _Link:
    """A rank's channel to the kernel through the run actor. `send` never waits: one thread sends what piled up,
    one actor call at a time (so messages arrive in order), every SEND_INTERVAL."""

    def __init__(self, rank: int, channel: Any) -> None:
        self.rank = rank
        self.capture: _Capture | None = None  # fds 1 and 2, once captured
        self.channel = channel
        self.lock = threading.Condition()
        self._pending: list[bytes] = []
        self._closing = False
        self._thread = threading.Thread(target=self._send_loop, name="ddpnb-link", daemon=True)
        self._thread.start()

    def send(self, message: msg.Message) -> None:
        self._put(msg.encode(message))

    def send_metric(self, step: int | None, values: dict[str, float]) -> None:
        self._put(msg.encode_metric(self.rank, step, time.time(), values))

    def flush(self) -> None:
        if self.capture is not None:
            self.capture.sync()

    def receive(self) -> bytes | None:
        """Sessions: the next command, long-polled from the run actor; None once the run actor is gone."""
        import ray

        while True:
            try:
                cell = ray.get(self.channel.next_cell.remote(self.rank, COMMAND_POLL))
            except ray.exceptions.RayActorError:
                return None
            if cell is not None:
                command, refs = cell
                fetched.receive(refs)  # before the command, whose big tensors and arrays refer to them, is unpickled
                return command

    def _put(self, data: bytes) -> None:
        with self.lock:
            self._pending.append(data)
            self.lock.notify()

    def _send_loop(self) -> None:
        import ray

        while True:
            with self.lock:
                self.lock.wait_for(lambda: self._pending or self._closing)
                batch, self._pending = self._pending, []
                closing = self._closing
            if batch:
                try:
                    ray.get(self.channel.put.remote(batch))
                except ray.exceptions.RayActorError:  # the run is over (stopped, or the kernel went away)
                    return
            if closing and not batch:
                return
            if not closing:
                time.sleep(SEND_INTERVAL)

    def close(self) -> None:
        """Deliver what is pending (a finished rank's last lines and result), then stop."""
        with self.lock:
            self._closing = True
            self.lock.notify()
        self._thread.join(CLOSE_WAIT)


class _Capture:
    """Fds 1 and 2 of this worker go through pipes while the rank runs, so C/C++ writes are captured too. Each
    chunk goes to the kernel, tagged with the rank, and on to where the fd pointed before: Ray's worker log."""

    def __init__(self, link: _Link) -> None:
        self.link = link
        self._saved: dict[int, int] = {}
        self._threads: list[threading.Thread] = []
        self._read_ends: list[int] = []
        self._forwarding = threading.Lock()  # held while a chunk read from a pipe is on its way to the link
        link.capture = self
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        for fd, name in ((1, "stdout"), (2, "stderr")):
            read_end, write_end = os.pipe()
            self._saved[fd] = os.dup(fd)
            os.dup2(write_end, fd)
            os.close(write_end)
            self._read_ends.append(read_end)
            thread = threading.Thread(
                target=self._forward, args=(read_end, self._saved[fd], name), name=f"ddpnb-{name}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        for stream in (sys.stdout, sys.stderr):
            if hasattr(stream, "reconfigure"):
                stream.reconfigure(line_buffering=True)

    def _forward(self, read_end: int, original: int, name: str) -> None:
        try:
            while data := os.read(read_end, 1 << 16):
                with self._forwarding:
                    self.link.send(Output(self.link.rank, name, data))
                _write_all(original, data)
        finally:
            os.close(read_end)

    def sync(self, wait: float = 1.0) -> None:
        """Until what was written to fds 1 and 2 so far is queued on the link (a session's answer must not overtake
        its cell's output): the pipes read empty, then no chunk on its way."""
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_unread(fd) for fd in self._read_ends):
            time.sleep(0.002)
        time.sleep(0.002)  # a chunk just read is under the lock by now
        with self._forwarding:
            return

    def close(self) -> None:
        """Put the fds back; the pipes' last write ends close, so the forwarders read to the end and stop."""
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        for fd, original in self._saved.items():
            os.dup2(original, fd)
        for thread in self._threads:
            thread.join(CLOSE_WAIT / 2)  # longer only if a child process still holds the pipe (then: it keeps it)
        if not any(thread.is_alive() for thread in self._threads):
            for original in self._saved.values():
                os.close(original)


def _unread(fd: int) -> int:
    """Bytes waiting in a pipe."""
    return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]


def _write_all(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data) :]
    except OSError:  # Ray's log file went away: the kernel still has the output
        return


def _serve_commands(link: _Link, channel: Any, finished: threading.Event, training_thread: int) -> None:
    """Long-poll the run actor for commands from the kernel. If the run actor is gone, so is the run: a rank
    still going then ends itself, as a local rank does when the kernel dies."""
    import ray

    seen = 0
    while not finished.is_set():
        try:
            seen, command = ray.get(channel.next_command.remote(seen, COMMAND_POLL))
        except ray.exceptions.RayActorError:
            if not finished.is_set():
                os.kill(os.getpid(), signal.SIGKILL)
            return
        if command == "stacks":
            link.send(Stacks(rank=link.rank, text=thread_stack(training_thread)))
        elif command and command.startswith("interrupt:") and str(link.rank) in command[10:].split(","):
            _interrupt(training_thread)


def _interrupt(thread_id: int) -> None:
    """KeyboardInterrupt in the session command the training thread runs. Ray Train runs the training function in
    a thread of its own, where no signal handler runs: the exception is set on that thread (CPython's
    PyThreadState_SetAsyncExc), and raised at its next Python instruction (a blocking C call ends first)."""
    if thread_id == threading.main_thread().ident:
        signal.pthread_kill(thread_id, signal.SIGINT)
        return
    import ctypes

    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(KeyboardInterrupt))
