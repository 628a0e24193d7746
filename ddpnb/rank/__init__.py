"""Code that runs inside every rank, whatever the engine: the call, the result, the process group, progress.

Each engine's own rank code (`node/rank.py`, `engines/ray/rank.py`) sets up the process and its link to
the kernel, then calls `rank.main.run_function`.
"""
