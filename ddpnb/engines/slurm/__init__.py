"""The slurm engine: a run's ranks as one `srun` job step inside the kernel's Slurm allocation, or, from a login
node, inside a job it asks for.

`engine.py` is the kernel's half (checks, the step, srun's lines), `options.py` its options, `allocation.py` reads
the job through `scontrol`, `submit.py` asks for a job outside an allocation (`salloc`) and gives it back, and
`host.py` is the step's one task on each node (`python -c "from ddpnb.engines.slurm.host import main; main()"`):
the remote layer's node host (`ddpnb.remote`), which also carries the channel between them. Nothing here imports
on `import ddpnb`.
"""
