"""The ray engine's launch without Ray Train, kernel side: a placement group reserves the ranks' CPUs and GPUs where
Ray places them; each node's host actor (`host.py`, started once per node and kernel) forks that node's ranks
from its warm forkserver; the kernel long-polls every host for its ranks' news. The hosts' account (ranks ended
once, a lost host's ranks, calls in order) is the remote layer's (`ddpnb.remote.hosts`), with Ray's actor calls as
its transport.

A host that dies (its node lost) ends its ranks' part of the run: each is named a failure that says so, and the
run stops the others as after any failure.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddpnb.core import pickling
from ddpnb.core.engine import AttemptStart, RunEvents
from ddpnb.core.spec import Stream, WorkerSpec
from ddpnb.engines.ray import versions
from ddpnb.engines.ray.data import ObjectStoreShipment
from ddpnb.node import forkserver
from ddpnb.node.forked import STACK_WAIT, STOP_GRACE
from ddpnb.node.rank import Seat
from ddpnb.remote.hosts import Hosts

TICK = 0.1  # seconds between two checks of the run (stop, timeout, announcements) while no host has news
HOLD = 0.5  # seconds a host's drain waits for news before it answers empty
CALL_WAIT = 30.0  # seconds a host may take to answer a call that should take milliseconds
REMOVE_WAIT = 1.0  # seconds `close` waits for Ray to count the run's CPUs as free (others may take them first)
HOST_START = 600.0  # seconds a new host may take to start (its node imports ddpnb)

_hosts: dict[str, Any] = {}  # node id -> its host actor


class WarmEngine:
    """One attempt's ranks, forked by the hosts of the nodes Ray placed them on."""

    def __init__(self, spec: WorkerSpec, placement: str, connect: Callable[[], None]) -> None:
        self.spec = spec
        self.placement = placement
        self._connect = connect
        self._run = Path(spec.run_dir).name + f"-{spec.attempt}"
        self._events: RunEvents | None = None
        self._group: Any = None
        self._payload = b""
        self._refs: dict[int, Any] = {}
        self._commands = False
        self._actors: dict[str, Any] = {}  # node id -> its host actor, once launched
        self._hosts: Hosts[str] = Hosts(spec.world_size)  # node id -> its ranks; commands kept till they are forked
        self._ips: dict[str, str] = {}  # node id -> its ip
        self._stopping = False

    def start(self, events: RunEvents, start: AttemptStart) -> None:
        from ray.util import placement_group

        self._events = self._hosts.events = events
        self._commands = start.commands
        # before anything starts: arguments that cannot be sent
        self._payload = pickling.dump_spec(self.spec, start.shipment)
        self._connect()
        # the function's and args' big tensors and arrays: put into the object store once, fetched once per node
        self._refs = start.shipment.put() if isinstance(start.shipment, ObjectStoreShipment) else {}
        bundle = {"CPU": 1, **({"GPU": 1} if self.spec.use_gpus else {})}
        self._group = placement_group(
            [bundle] * self.spec.world_size, strategy=self.placement, name=f"ddpnb-{self._run}"
        )

    # --- the reader ------------------------------------------------------------------------------------------------
    def serve(self) -> None:
        assert self._events is not None
        try:
            if self._placed():
                self._launch()
                self._relay()
        except _Stopped:  # while the ranks were being forked: the `finally` says so, `close` ends them
            pass
        except Exception as exc:  # noqa: BLE001 - Ray failed under us (the cluster went away): end the run, saying why
            self._hosts.lose(self._hosts.left(), f"lost the Ray run: {type(exc).__name__}: {exc}")
        finally:
            self._hosts.lose(self._hosts.left(), "", stopped=True)  # stopped before they were forked

    def _placed(self) -> bool:
        """Wait until Ray has reserved every rank's bundle (a busy cluster: until it has room); False if stopped."""
        assert self._events is not None
        while not self._group.wait(TICK):  # asks Ray's control store (`ready()` would run a task in the group)
            self._events.tick()
            if self._stopping:
                return False
        return not self._stopping

    def _launch(self) -> None:
        """Each node's ranks forked by its host: ranks numbered node by node, rank 0's node holding the store. A host
        that dies meanwhile (its node lost) loses its node's ranks; the other nodes' ranks go on to their end."""
        import ray
        from ray.util import placement_group_table

        bundles = placement_group_table(self._group)["bundles_to_node_id"]
        nodes = list(dict.fromkeys(bundles[index] for index in range(self.spec.world_size)))
        self._actors, where = _hosts_on(nodes)
        gpus = _gpu_ids(self._group, self.spec.world_size) if self.spec.use_gpus else {}
        single = len(nodes) == 1
        placed = {node: [index for index in range(self.spec.world_size) if bundles[index] == node] for node in nodes}
        first = 0
        for node in nodes:  # ranks numbered node by node
            self._hosts.place(node, list(range(first, first + len(placed[node]))))
            self._ips[node] = where[node][1]
            first += len(placed[node])
        try:
            port = ray.get(self._actors[nodes[0]].bind_store.remote(self._run, single), timeout=CALL_WAIT)
        except ray.exceptions.RayActorError as exc:  # without rank 0's store no rank can start: none is forked
            self._host_lost(nodes[0], exc)
            return
        master = "127.0.0.1" if single else where[nodes[0]][1]
        seats: dict[str, list[Seat]] = {}
        rank = 0
        for node_rank, node in enumerate(nodes):
            mine = placed[node]
            # in local-rank order: each rank's device is its LOCAL_RANK
            visible = [gpus[index] for index in mine] if gpus else []
            # the node's ranks see all of its run's GPUs, each using its own (NCCL's peer-to-peer paths need both)
            environ = {"CUDA_VISIBLE_DEVICES": ",".join(visible)} if gpus else {}
            seats[node] = []
            for local_rank, index in enumerate(mine):
                seats[node].append(
                    Seat(
                        rank,
                        local_rank,
                        len(mine),
                        "",
                        node_rank,
                        master,
                        port,
                        visible.index(gpus[index]) if gpus else None,
                        environ,
                    )
                )
                rank += 1
        notes = self._wait(
            {
                node: self._actors[node].start.remote(
                    self._run,
                    self._payload,
                    seats[node],
                    self._refs,
                    self._commands,
                    forkserver.preloaded(),
                    versions(),
                )
                for node in nodes
            }
        )
        for note in itertools.chain(*notes.values()):
            print(note, file=sys.stderr)
        self._hosts.open()  # commands sent while the ranks were being forked go first, in order

    def _wait(self, calls: dict[str, Any]) -> dict[str, Any]:
        """The hosts' answers to a slow call (a new host's first fork waits for its `import torch`; a preload
        restarts its forkserver; notebook data is fetched), checking the run meanwhile: a stop or the timeout
        ends the wait (the hosts' `close` then takes whatever they forked). A host that died before it answered
        (its node lost; a rank may kill it as soon as it is forked) has no answer: its node's ranks are lost."""
        import ray

        assert self._events is not None
        refs = list(calls.values())
        deadline = time.monotonic() + HOST_START
        while len(ray.wait(refs, num_returns=len(refs), timeout=TICK)[0]) < len(refs):
            self._events.tick()
            if self._stopping or time.monotonic() > deadline:
                raise _Stopped
        answers = {}
        for node, ref in calls.items():
            try:
                answers[node] = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                self._host_lost(node, exc)
        return answers

    def _relay(self) -> None:
        """Every host's news as it comes (one long poll per host), until every host's ranks have ended."""
        import ray

        assert self._events is not None
        polls = {host.drain.remote(self._run, HOLD): node for node, host in self._actors.items()}
        while polls:
            ready, _ = ray.wait(list(polls), num_returns=1, timeout=TICK)
            for ref in ready:
                node = polls.pop(ref)
                try:
                    batch, done = ray.get(ref)
                except ray.exceptions.RayError as exc:  # the host died: its node was lost, or its process killed
                    self._host_lost(node, exc)
                    continue
                self._replay(node, batch)
                if not done:
                    polls[self._actors[node].drain.remote(self._run, HOLD)] = node
            self._events.tick()

    def _replay(self, node: str, batch: list[tuple[Any, ...]]) -> None:
        events = self._events
        assert events is not None

        def placed(rank: int, pid: int | None) -> None:
            line = f"[ddpnb] on Ray node {node[:12]} ({self._ips.get(node, '?')}), pid {pid}\n"
            events.output(rank, Stream.STDOUT, line.encode())

        self._hosts.replay(node, node, batch, placed=placed)

    def _host_lost(self, node: str, exc: Exception) -> None:
        """The node's host died: its ranks fail, saying so; no later call goes to it; the next launch starts another."""
        _hosts.pop(node, None)
        self._actors.pop(node, None)
        self._hosts.lose(
            self._hosts.left(node), f"its Ray node {self._ips.get(node, '?')} was lost ({type(exc).__name__})"
        )

    # --- stopping and commands --------------------------------------------------------------------------------------
    def stop(self, ranks: list[int], failed: bool) -> float | None:
        self._stopping = True
        for host in self._actors.values():
            host.stop.remote(self._run, ranks)
        return STOP_GRACE

    def escalate(self) -> float | None:
        for host in self._actors.values():
            host.escalate.remote(self._run)
        return None

    def collect_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Each host's ranks' stacks; a host that does not answer in time (or died) gives none."""
        import ray

        refs = [host.collect_stacks.remote(self._run, ranks) for host in self._actors.values()]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=STACK_WAIT + CALL_WAIT)
        stacks: dict[int, str] = {}
        for ref in ready:
            try:
                stacks.update(ray.get(ref))
            except ray.exceptions.RayError:  # that host is gone: its ranks' end says so
                continue
        return stacks

    def send(self, ranks: list[int], command: bytes, shipment: Any = None) -> None:
        # the command's big tensors and arrays: put once (or reused), fetched once per node by its host
        refs = shipment.put() if isinstance(shipment, ObjectStoreShipment) else {}
        self._hosts.in_order(
            lambda number: [host.send.remote(self._run, number, ranks, command, refs) for host in self._actors.values()]
        )

    def interrupt(self, ranks: list[int]) -> None:
        self._hosts.in_order(
            lambda number: [host.interrupt.remote(self._run, number, ranks) for host in self._actors.values()]
        )

    def close(self) -> None:
        import ray

        try:
            ray.get([host.close.remote(self._run) for host in self._actors.values()], timeout=CALL_WAIT)
        except Exception:  # noqa: BLE001, S110 - a host is gone (its ranks with it), or Ray is (the kernel is exiting)
            pass
        if self._group is not None:
            try:
                _remove(self._group, self.spec.world_size)
            except Exception as exc:  # noqa: BLE001 - say so: its CPUs/GPUs stay reserved until the kernel exits
                print(
                    f"[ddpnb] the run's Ray placement group could not be released ({type(exc).__name__}: {exc}); "
                    "its CPUs and GPUs stay reserved until this kernel exits.",
                    file=sys.stderr,
                )
        self._events = None  # the run and its value go with the caller's last reference, not at the next gc


class _Stopped(Exception):
    """The run was stopped while its ranks were being forked."""


def _hosts_on(nodes: list[str]) -> tuple[dict[str, Any], dict[str, tuple[str, str, int]]]:
    """Each node's host and where it runs (node id, ip, pid); a host that died since the last run (its process
    killed, or the node's Ray restarted) is replaced by a new one."""
    import ray

    hosts = {node: _host(node) for node in nodes}
    asked = {node: hosts[node].where.remote() for node in nodes}
    where = {}
    for node, ref in asked.items():
        try:
            where[node] = ray.get(ref, timeout=HOST_START)
        except ray.exceptions.RayActorError:
            _hosts.pop(node, None)
            hosts[node] = _host(node)
            where[node] = ray.get(hosts[node].where.remote(), timeout=HOST_START)
    return hosts, where


def _host(node: str) -> Any:
    """The node's host actor, started on the node the first time a run needs it. A node of another cluster, or of
    Ray restarted, has another id; a host that died is replaced (`_hosts_on`)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from ddpnb.engines.ray.host import Host

    if node not in _hosts:
        _hosts[node] = (
            ray.remote(Host)
            .options(
                num_cpus=0,
                max_concurrency=64,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
            )
            .remote()
        )
    return _hosts[node]


def _remove(group: Any, cpus: int) -> None:
    """Release the run's reservation, and wait (briefly) until Ray counts its CPUs as free again: a group asked for
    before then (the next cell's, at once) waits for Ray's next scheduling round, a second later."""
    import ray
    from ray.util import remove_placement_group

    free = ray.available_resources().get("CPU", 0)
    remove_placement_group(group)
    deadline = time.monotonic() + REMOVE_WAIT
    while ray.available_resources().get("CPU", 0) < free + cpus and time.monotonic() < deadline:
        time.sleep(0.005)


def _gpu_ids(group: Any, world_size: int) -> dict[int, str]:
    """The GPU Ray reserved in each bundle (an index, or a UUID where the node names its GPUs so), learned by a
    task that runs in it."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=0, num_gpus=1)
    def gpu_id() -> str:
        return str(ray.get_gpu_ids()[0])

    return dict(
        enumerate(
            ray.get(
                [
                    gpu_id.options(
                        scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)
                    ).remote()
                    for index in range(world_size)
                ],
                timeout=HOST_START,
            )
        )
    )
