"""The slurm engine: a run's ranks as one `srun` job step inside the kernel's Slurm allocation.

`engine.py` is the kernel's half (options, checks, the step, the channel's listener), `allocation.py` reads the
job through `scontrol`, `wire.py` is what kernel and ranks say to each other, and `rank.py` is the rank's half,
run by srun on each node (`python -c "from ddpnb.engines.slurm.rank import main; main()"`). Nothing here
imports on `import ddpnb`.
"""
