"""Detached runs (docs/detached.md): a run owned by a supervisor process of its own, not by the kernel, which any
later kernel attaches to.

`supervisor`: the owner, forked from the kernel's forkserver into a session of its own; it runs the same
`Lifecycle` with the journal on, keeps rank 0's result in the run directory and takes commands at a door only
holders of the run's secret pass. `attach`: a viewer's handle, built on the journal's replay (`core.journal`).
`files`: what lives in a detached run's directory, and the door's client.
"""
