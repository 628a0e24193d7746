"""The front end a run was started from, as the run asks it (`core.run.FrontEnd`): the cell's input box answers
the ranks' debugger prompts (the thread of the cell that waits for the run, a session's command, or a later
cell's `Run.debug`: each holds the kernel's stdin), its stderr hears a view's failure, and a cell that displays the
run's handle shows the run. The dashboard's console
answers the same prompts for a cell that has returned (`views.console`); whichever answer comes first is sent."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from ddpnb.core import messages as msg
from ddpnb.core.cellnames import pdb_cell_names
from ddpnb.core.report import named
from ddpnb.core.spec import ViewKind

if TYPE_CHECKING:
    from ddpnb.core.run import Run

GOES_ON = frozenset({"c", "cont", "continue", "q", "quit", "exit"})  # pdb commands that leave its prompt
TICK = 1.0  # seconds `debug` waits for a rank's next prompt before it looks again


class CellFrontEnd:
    """`input()` and `print()` of the cell that runs: a Jupyter cell's input box and output, or a terminal's.
    `view`, `fold`: the view the launch drew, which a cell displaying the handle draws again."""

    def __init__(self, view: ViewKind = ViewKind.TEXT, fold: bool = True) -> None:
        self.view = view
        self.fold = fold

    def answer_prompts(self, run: Run) -> None:
        """Each rank's debugger prompt in turn, asked in the input box; a Ctrl-C there interrupts the caller's wait
        as anywhere else in it."""
        while (prompt := run.attempt.broker.next_prompt()) is not None:
            self._ask(run, prompt)

    def debug(self, run: Run, rank: int) -> None:
        """Answer `rank`'s prompts until it goes on (`c`) or quits (`q`); Ctrl-C leaves, the rank still waiting."""
        waiting = run.attempt.broker.waiting.get(rank)
        if waiting is None:
            at = sorted(run.attempt.broker.waiting)
            print(
                f"[ddpnb] rank {rank} is not at a debugger prompt"
                + (f"; {named(at)} {'is' if len(at) == 1 else 'are'}: .debug({at[0]})" if at else "")
                + "."
            )
            return
        print(
            f"[ddpnb] rank {rank}'s debugger, until it goes on (c) or quits (q); Ctrl-C returns here with the "
            "rank still waiting",
            flush=True,
        )
        seen = 0
        while not run.done:
            prompt = run.attempt.broker.waiting.get(rank)
            if prompt is None:  # the rank is running its command: its next prompt, or its end
                seen = run.watch(seen, TICK)
                continue
            line, sent = self._ask(run, prompt)
            if not sent:
                return
            if line.strip().split(" ")[0] in GOES_ON:
                return

    def view_failed(self, view: str, exc: Exception) -> None:
        print(
            f"[ddpnb] the {view} could not draw ({type(exc).__name__}: {exc}): a ddpnb bug, please report it with "
            "the run directory; the run and its result are unaffected",
            file=sys.stderr,
            flush=True,
        )

    def show(self, run: Run) -> None:
        """The run's live dashboard, drawn anew in the cell that displays its handle while the run goes on (the
        launch's cell may be gone: a browser reload, a closed tab); where the launch drew none, or the run has
        ended, its one-line status."""
        from IPython.display import display

        if self.view is ViewKind.WIDGET and not run.done:
            from ddpnb.views.dashboard import Dashboard

            Dashboard(run, foreground=False, fold=self.fold)
        else:
            display({"text/plain": repr(run)}, raw=True)

    @staticmethod
    def _ask(run: Run, prompt: msg.Prompt) -> tuple[str, bool]:
        """The input box's line for `prompt`, and whether it was sent; where not (answered elsewhere meanwhile, or
        the run ended while the input box waited), says so."""
        run.notify()  # the rank's output up to its breakpoint first
        said, _, ask = prompt.text.rpartition("\n")
        if said:
            print(pdb_cell_names(said), flush=True)
        try:
            line = input(f"(rank {prompt.rank}) {ask}")
        except (EOFError, NotImplementedError):  # no more input, or this cell's front end takes none (IPython's
            # StdinNotImplementedError): the rank goes on
            print(
                f"[ddpnb] rank {prompt.rank}'s debugger prompt cannot be answered here: it continues.", file=sys.stderr
            )
            line = "c"
        sent = run.answer(prompt, line)
        if not sent:
            print(
                f"[ddpnb] {line!r} was not sent: rank {prompt.rank} no longer waits at that prompt: "
                f"{run.not_waiting(prompt.rank)}",
                flush=True,
            )
        return line, sent
