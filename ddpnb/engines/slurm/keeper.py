"""Run as a script (`python keeper.py salloc ...`, importing nothing of ddpnb): salloc's parent, which cancels the
job it asked for if the kernel lets go of its pipe on stdin while the job still waits in the queue, however the
kernel ended.

salloc runs `cat` on that pipe once the job is granted, so a running job already ends with its kernel. A job still
in the queue has no `cat` yet: without the keeper, a kernel killed outright would leave it queued, to start (and at
once end) whenever its turn came. The keeper passes salloc's lines on to the kernel, noting the job's ID and its
grant, and cancels only a job that was not granted: salloc 22.05 sent SIGTERM as its granted `cat` ends spins at
full CPU instead of exiting, so a granted job is left to `cat`. It exits with salloc's status.
"""

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

JOB_ID = re.compile(r"job allocation (\d+)")  # as `submit.JOB_ID`: "salloc: Pending job allocation 12"
GRANTED = "Granted job allocation"


def main() -> None:
    salloc = subprocess.Popen(sys.argv[1:], stderr=subprocess.PIPE, text=True)  # stdin: the kernel's pipe
    scancel = str(Path(sys.argv[1]).with_name("scancel"))
    job = {"id": "", "granted": False}

    def relay() -> None:
        assert salloc.stderr is not None
        for line in salloc.stderr:
            found = JOB_ID.search(line)
            job["id"] = job["id"] or (found.group(1) if found else "")
            job["granted"] = job["granted"] or GRANTED in line
            sys.stderr.write(line)
            sys.stderr.flush()

    def cancel(*_: object) -> None:
        if job["granted"] or salloc.poll() is not None:
            return
        if job["id"]:
            subprocess.run([scancel, job["id"]], check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        else:  # no job yet: salloc cancels its request itself
            salloc.send_signal(signal.SIGTERM)

    def watch() -> None:
        while os.read(0, 4096):  # nothing is ever written: the end of input is the kernel letting go, or dying
            continue
        cancel()

    signal.signal(signal.SIGTERM, cancel)
    relaying = threading.Thread(target=relay)
    relaying.start()
    threading.Thread(target=watch, daemon=True).start()
    code = salloc.wait()
    relaying.join()  # every line salloc said reaches the kernel (a refusal's reason) before the keeper ends
    sys.exit(code)


if __name__ == "__main__":
    main()
