"""The slurm engine: a run's ranks as one `srun` job step inside the kernel's Slurm allocation, or, from a login
node, inside a job it asks for.

`engine.py` is the kernel's half (checks, the step, the channel's listener), `options.py` its options,
`allocation.py` reads the job through `scontrol`, `submit.py` asks for a job outside an allocation (`salloc`) and
gives it back, `wire.py` is what kernel and hosts say to each other (and notebook data crossing once per node),
and `host.py` is the step's one task on each node, which forks that node's ranks from its forkserver
(`ddpnb.node`) and relays their events (`python -c "from ddpnb.engines.slurm.host import main; main()"`). Nothing here imports on
`import ddpnb`.
"""
