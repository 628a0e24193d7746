"""The slurm engine: a run's ranks as one `srun` job step inside the kernel's Slurm allocation, or, from a login
node, inside a job it asks for.

`engine.py` is the kernel's half (checks, the step, the channel's listener), `options.py` its options,
`allocation.py` reads the job through `scontrol`, `submit.py` asks for a job outside an allocation (`salloc`) and
gives it back, `wire.py` is what kernel and ranks say to each other, and `rank.py` is the rank's half, run by srun
on each node (`python -c "from ddpnb.engines.slurm.rank import main; main()"`). Nothing here imports on
`import ddpnb`.
"""
