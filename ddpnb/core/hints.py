"""What to do next: the line under a failed run's report, and the once-per-kernel preload hint."""

from __future__ import annotations

from ddpnb.core import checkpoints
from ddpnb.core import messages as msg
from ddpnb.core.record import Diagnosis, Outcome, RunRecord

_hinted: set[tuple[str, ...]] = set()  # modules `preload_hint` already named in this kernel


def hint(record: RunRecord) -> str:
    """What to do next, under a failed run's report; and how to continue from its checkpoint, where it has one."""
    found = checkpoints.latest(record.checkpoint_dir) if record.checkpoint_dir else None
    resume = (
        f"\nIts latest complete checkpoint is step {found[0]}: `%%ddp --resume last` (or resume='last') "
        "continues from it."
        if found
        else ""
    )
    return _next_step(record) + resume


def _next_step(record: RunRecord) -> str:
    if record.outcome is Outcome.TIMED_OUT:
        return _timed_out(record.at_timeout)
    if record.outcome is Outcome.INTERRUPTED:
        return "Every rank was stopped; run the cell again when ready."
    if record.outcome is Outcome.STOPPED:
        return "Run the cell again to start afresh; the kernel and its variables are unchanged."
    first = record.first_failure
    if first is None and record.internal_errors:
        return (
            "ddpnb failed, not your code: please report it with the run directory (the tracebacks above are in "
            "its record's `internal_errors`); the kernel and its variables are unchanged."
        )
    if first and first.summary.startswith("killed by"):
        return (
            "A rank died from a signal (a crash in C/C++ code, or the out-of-memory killer); its log shows its last "
            "output and, after a crash, where Python was."
        )
    return "Fix the error above and run the cell again; the kernel and its variables are unchanged."


def _timed_out(where: Diagnosis | None) -> str:
    """The collective hint only where it fits: a rank waited in one while another had ended or was elsewhere."""
    ranks = where.ranks if where is not None else []
    waiting = [rank for rank in ranks if rank.waits_in]
    if waiting and len(waiting) < len(ranks):
        return (
            "The stacks above show where each rank was: a collective waits until every rank reaches it, so a "
            "rank that never does (it has ended, or is elsewhere) hangs the ranks waiting in it."
        )
    return "The stacks above show where each rank was when the timeout stopped the run."


def preload_hint(imported: msg.Imported) -> str:
    """Once per kernel and set of modules: what rank 0 spent importing at this launch, and how to stop paying."""
    if imported.modules in _hinted:
        return ""
    _hinted.add(imported.modules)
    names = ", ".join(map(repr, imported.modules))
    return (
        f"rebuilding the function took rank 0 {imported.seconds:.1f} s, importing {names}, as every rank does at "
        f"every launch; ddpnb.preload({names}) imports {'it' if len(imported.modules) == 1 else 'them'} once, in "
        "the process ranks are forked from."
    )
