"""The local engine: ranks forked from a pre-warmed forkserver on this machine (engine.py in the kernel; the
forking itself, and each rank's side, are `ddpnb.node`'s)."""
