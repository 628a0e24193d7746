"""Run as a script (`python keeper.py salloc ...`, importing nothing of ddpnb): salloc's parent, which ends it once
the kernel's pipe on stdin closes, however the kernel ended.

salloc runs `cat` on that pipe once the job is granted, so a running job already ends with its kernel. A job still
waiting in the queue has no `cat` yet: without this, a kernel killed outright would leave it queued, to start
(and at once end) whenever its turn came. SIGTERM makes salloc cancel a job it waits for, or give back one it
holds. The keeper passes its own SIGTERM on, and exits with salloc's status.
"""

import os
import signal
import subprocess
import sys
import threading


def main() -> None:
    salloc = subprocess.Popen(sys.argv[1:])  # stdin (the pipe) and stderr (salloc's lines) are shared with it

    def end(*_: object) -> None:
        if salloc.poll() is None:
            salloc.send_signal(signal.SIGTERM)

    def watch() -> None:
        while os.read(0, 4096):  # nothing is ever written: the end of input is the kernel letting go, or dying
            continue
        end()

    signal.signal(signal.SIGTERM, end)
    threading.Thread(target=watch, daemon=True).start()
    sys.exit(salloc.wait())


if __name__ == "__main__":
    main()
