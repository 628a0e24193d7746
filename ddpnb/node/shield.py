"""Imported first in the forkserver, before torch: the kernel's interrupt must not kill it while it imports.

Jupyter interrupts a kernel by signalling its whole process group, which holds the forkserver the kernel started;
multiprocessing's forkserver ignores SIGINT only once its preloading is done, so an interrupt during a kernel's
first launch killed it halfway through `import torch`, and the next launch found it dead. Ranks get Python's own
SIGINT handler back as they start (`rank.entry`).

SIGUSR1 asks a rank for its stacks; ignored from the fork until the rank's faulthandler takes it over (`rank._setup`),
so a request that comes while a rank still starts finds no stack rather than killing it (its default action).

The forkserver is a child subreaper: what a dead rank left running becomes its child, where the process that forked
the ranks ends it (`node/orphans.py`); the forkserver reaps it then, as a PID it did not fork, which it would
otherwise warn about on the kernel's stderr.
"""

import signal
import warnings

from ddpnb.node.orphans import become_subreaper

signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGUSR1, signal.SIG_IGN)
become_subreaper()
warnings.filterwarnings("ignore", message="forkserver: waitpid returned unexpected pid")
