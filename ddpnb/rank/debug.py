"""`breakpoint()` on a rank: pdb's prompt goes to the notebook over the engine's channel, its answers come back.

A rank has no terminal: its stdin is not the notebook's. `install` points `breakpoint()`, `pdb.set_trace()` and
`torch.distributed.breakpoint()` at a pdb whose output is gathered until it asks for a line; then the rank sends
it as one `Prompt` and waits for the kernel's answer (`Link.receive`), which the kernel asks the front end for
through its input box. Where the front end takes no input (nbclient, a script, a background run), a breakpoint
is skipped with a note naming the rank and its line, as `PYTHONBREAKPOINT=0` would skip it silently.
"""

from __future__ import annotations

import io
import pdb
import sys
from types import FrameType
from typing import Any

from ddpnb.core import messages as msg
from ddpnb.core.stacks import to_the_callers
from ddpnb.rank import cells
from ddpnb.rank import context as ctx


class _Gathered(io.StringIO):
    """pdb's output, held until pdb asks for a line: then it travels with the prompt."""

    def take(self) -> str:
        text = self.getvalue()
        self.seek(0)
        self.truncate()
        return text


class _Answers:
    """pdb's input: each line it reads is the kernel's answer to the prompt sent just before."""

    def __init__(self, context: ctx.RankContext, gathered: _Gathered) -> None:
        self.context = context
        self.gathered = gathered

    def readline(self) -> str:
        self.context.send(msg.Prompt(rank=self.context.rank, text=self.gathered.take()))
        self.context.link.flush()
        answer = self.context.link.receive()
        if answer is None:  # the kernel is gone, or the run is ending: leave the debugger
            return ""
        return answer.decode(errors="replace").rstrip("\n") + "\n"


class RankPdb(pdb.Pdb):
    """pdb reading from the kernel's answers and writing into the next prompt."""

    def __init__(self, context: ctx.RankContext) -> None:
        gathered = _Gathered()
        # stepping never stops inside ddpnb or torch: a prompt always lands on the user's own line
        super().__init__(
            stdin=_Answers(context, gathered),
            stdout=gathered,  # type: ignore[arg-type]
            skip=["ddpnb.*", "torch.*"],
            nosigint=True,
        )
        self.use_rawinput = False
        self.prompt = "(Pdb) "


def post_mortem(context: ctx.RankContext, exc: BaseException) -> None:
    """pdb at the frame that raised `exc` (`--debug`), until the user leaves it (q, c)."""
    tb = exc.__traceback__
    if getattr(exc, "__ddpnb_callers__", False):  # an error about how ddpnb was called: at the user's line
        tb = to_the_callers(tb)
    debugger = RankPdb(context)
    debugger.reset()
    try:
        debugger.interaction(None, tb)
    except Exception:  # noqa: BLE001 - pdb's own quit (BdbQuit) or a broken channel: the report follows anyway
        return


def install(context: ctx.RankContext, prompts: bool) -> None:
    """Every way user code enters pdb, pointed at the notebook (`prompts`) or at a note that skips it."""

    def enter(frame: FrameType) -> None:
        if prompts:
            RankPdb(context).set_trace(frame)
        else:
            where = cells.location(frame.f_code.co_filename, frame.f_lineno)
            print(
                f"[ddpnb] breakpoint() on rank {context.rank} at {where} skipped: this front end takes no input "
                "(nbclient, a script, a --background run); run the cell in Jupyter, in the foreground, to get "
                "its prompt.",
                file=sys.stderr,
                flush=True,
            )

    def breakpointhook(*args: Any, **kwargs: Any) -> None:
        enter(sys._getframe(1))

    def set_trace(*, header: str | None = None) -> None:
        enter(sys._getframe(1))

    sys.breakpointhook = breakpointhook
    pdb.set_trace = set_trace
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None:

        def distributed_breakpoint(rank: int = 0, skip: int = 0, timeout_s: float = 3600) -> None:
            """torch's: every rank meets at a barrier, then `rank`'s prompt opens at the caller's next line
            (torch's reads /dev/stdin, which a rank does not have)."""
            if distributed.get_rank() == rank:
                enter(sys._getframe(1))
            distributed.barrier()

        distributed.breakpoint = distributed_breakpoint
