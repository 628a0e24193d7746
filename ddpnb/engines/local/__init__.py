"""The local engine: ranks forked from a pre-warmed forkserver on this machine (engine.py and forkserver.py in
the kernel, rank.py in each rank)."""
