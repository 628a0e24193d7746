"""Ranks forked on one machine: the pre-warmed forkserver (forkserver.py, its shield.py), the ranks forked from
it (forked.py, read by the process that forked them), and each rank's own side (rank.py, mapped.py). The local
engine forks them in the kernel; the Ray engine in a host actor on each node."""
