"""The remote layer: what every engine whose ranks live behind a host process on each node shares (the Slurm
engine's srun tasks, the Ray engine's warm host actors; an SSH or Kubernetes engine, a detached run's supervisor).

`hosts.py` is the kernel's account of a run's hosts, whatever carries their calls: which ranks each forks, each
rank ended once, a lost host's ranks lost, calls made before the hosts could take them kept in order, stacks
requests numbered. Over TCP: `door.py` lets in only connections that prove the run's secret, `wire.py` is what
kernel and hosts say (and notebook data crossing once per node), `connections.py` is the kernel's end (admission,
set-up, sending, reading, hang-up), and `host.py` is the host process on a node, which forks that node's ranks
(`ddpnb.node`) and relays their events. An engine brings its scheduler's part: where hosts start, how they learn
the door's address, its own words. Nothing here imports an engine.
"""
