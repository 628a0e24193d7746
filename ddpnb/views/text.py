"""Plain-text view of a run: `[rank N]` lines while it runs, a per-rank summary at the end.

Used wherever no widget front end exists (terminal IPython, scripts, nbconvert/nbclient, CI). It reads the run's
record when the run's reader has news (output at most five times a second); it never slows the workers, and it
shows at most `max_lines` lines, saying how many it skipped (every line is in the rank's log file). The same
line from several ranks shows once, `[ranks 0-3] ...` (`views.fold`), unless `fold=False`.
"""

from __future__ import annotations

import sys
import time

from ddpnb.core import checkpoints
from ddpnb.core.output import split_at_restarts
from ddpnb.core.record import AttemptRecord, Outcome, RunRecord, Stall
from ddpnb.core.report import (
    diagnosis_lines,
    diagnosis_summary,
    grouped_stacks,
    log_files,
    named,
    restart_line,
    stall_headline,
    summary_table,
)
from ddpnb.core.run import Run
from ddpnb.core.spec import Stream
from ddpnb.core.words import format_duration, ranks_text
from ddpnb.views.fold import FoldedLine, Folder
from ddpnb.views.profile import profile_text

QUEUE_SAY_EVERY = 60.0  # seconds between two lines about a job whose queue state did not change


class TextView:
    def __init__(self, run: Run, max_lines: int, fold: bool = True) -> None:
        self.run = run
        self.out = sys.stdout
        self.err = sys.stderr
        self.max_lines = max_lines
        self.seen = 0  # sequence number of the last line looked at
        self.shown = 0
        self.skipped = 0
        self.summarised = False
        self.restarts_shown = 0  # earlier attempts whose restart line was written
        self.stall_shown: Stall | None = None  # the stall whose lines were written
        self.places_shown = ""  # ... and where its ranks were, as last written
        self.resume_shown: Stall | None = None  # ... and whose end was
        self.queue_said: tuple[str, str, bool] | None = None  # the job's queue state as last written
        self.queue_said_at = 0.0
        record = run.record
        self.folder = Folder(record.world_size, enabled=fold)
        devices = ", ".join(sorted({r.device for r in record.ranks}))
        note = f"; {record.launch_note}" if record.launch_note else ""
        self.out.write(
            f"[ddpnb] {record.function} on {ranks_text(record.world_size)}, backend {record.backend}, "
            f"devices {devices}{note}; logs in {record.run_dir}\n"
        )
        run.subscribe(self.update)

    def update(self) -> None:
        run = self.run
        done = run.done  # before reading: the lines read after it are the last ones
        new, skipped_by_window, self.seen = run.lines_since(self.seen)
        self.skipped += skipped_by_window
        now = time.monotonic()
        # a restart's line goes where it happened: after the last line of the attempt it ended, once read
        for lines, attempt in split_at_restarts(new, run.record.attempts[self.restarts_shown :], self.seen):
            self._write(self._limit(self.folder.add(lines, now) + (self.folder.flush() if attempt or done else [])))
            if attempt is not None:
                self._restarted(attempt)
        self._queued()
        self._stall()
        self.out.flush()
        self.err.flush()
        if done and not self.summarised:
            self.summarised = True
            self._summary()

    def _limit(self, lines: list[FoldedLine]) -> list[FoldedLine]:
        """The first `max_lines` lines shown; the rest counted (a folded line counts once per rank)."""
        shown = lines[: max(0, self.max_lines - self.shown)]
        self.shown += len(shown)
        self.skipped += sum(len(line.ranks) for line in lines[len(shown) :])
        return shown

    def _write(self, shown: list[FoldedLine]) -> None:
        """One write per run of same-stream lines: a busy run redraws in a few writes, in the ranks' order."""
        start = 0
        for end in range(1, len(shown) + 1):
            if end == len(shown) or shown[end].stream is not shown[start].stream:
                stream = self.err if shown[start].stream is Stream.STDERR else self.out
                stream.write("".join(f"{line.tag} {line.text}\n" for line in shown[start:end]))
                start = end

    def _queued(self) -> None:
        """The run's job's queue state as it changes, and once a minute while it stays; then how long it waited."""
        queued = self.run.record.queued
        if queued is None:
            return
        said, now = (queued.what, queued.state, queued.ongoing), time.monotonic()
        if said != self.queue_said or (queued.ongoing and now - self.queue_said_at > QUEUE_SAY_EVERY):
            self.queue_said, self.queue_said_at = said, now
            tail = " (interrupt or stop the run to cancel it)" if queued.ongoing else ""
            self.out.write(f"[ddpnb] {queued.words()}{tail}\n")

    def _stall(self) -> None:
        """A stall's lines and the ranks' stacks where it was found, again when a later look finds a rank
        elsewhere; one line when progress resumes."""
        record = self.run.record
        stall = record.stall
        if stall is None:
            return
        places = diagnosis_summary(stall.diagnosis)
        if stall is not self.stall_shown or (record.stalled and places != self.places_shown):
            again = stall is self.stall_shown
            self.stall_shown, self.places_shown = stall, places
            self.out.write(stall_lines(stall, again=again))
        if not stall.ongoing and stall is not self.resume_shown:
            self.resume_shown = stall
            assert stall.resumed is not None
            self.out.write(
                f"[ddpnb] progress resumed: no longer stalled, after {format_duration(stall.resumed - stall.since)} "
                "without progress\n"
            )

    def _restarted(self, attempt: AttemptRecord) -> None:
        self.restarts_shown += 1
        self.out.write(f"[ddpnb] {restart_line(attempt, self.run.record.max_restarts)}\n")

    def _summary(self) -> None:
        record = self.run.record
        if self.skipped:
            self.out.write(
                f"[ddpnb] {self.skipped} lines not shown here (limit {self.max_lines}, "
                f"DDPNB_MAX_LINES); every line is in the logs: {record.run_dir}\n"
            )
        again = f" after {record.attempt} restart{'s' if record.attempt > 1 else ''}" if record.attempt else ""
        self.out.write(f"[ddpnb] run {record.outcome.value}{again} in {format_duration(record.duration)}\n")
        if record.outcome is Outcome.SUCCEEDED:  # a failure's report carries the table and the logs already
            self.out.write(summary_table(record) + "\n")
            if record.attempts:  # the restart lines named each attempt's as it began: all of them, once more
                self.out.write(f"[ddpnb] every attempt's logs: {log_files(record)}\n")
        if record.profile is not None:
            self.out.write(profile_text(record.profile) + "\n")
        if record.hint:
            self.out.write(f"[ddpnb] {record.hint}\n")
        found = checkpoints.latest(record.checkpoint_dir) if record.checkpoint_dir else None
        if found and record.outcome is not Outcome.SUCCEEDED:
            self.out.write(
                f"[ddpnb] continue from its checkpoint of step {found[0]}: %%ddp --resume last "
                f"(or --resume {record.run_dir})\n"
            )
        self.out.flush()


def stall_lines(stall: Stall, going: str = "the run", again: bool = False) -> str:
    """`[ddpnb] stalled: ...` with the grouped summary, each rank's line and the flight recorder's, then each
    rank's stack as the stall doctor took it; `going` is what goes on meanwhile; `again`: a later look at a stall
    already said, whose ranks moved."""
    headline = stall_headline(stall)
    lines = [f"[ddpnb] {'still ' + headline if again else headline}"]
    lines += [f"[ddpnb]   {line}" for line in [*diagnosis_lines(stall.diagnosis), *stall.diagnosis.flight]]
    lines.append(
        f"[ddpnb]   {going} goes on; each rank's stack:" if stall.diagnosis.stacks else f"[ddpnb]   {going} goes on"
    )
    for ranks, text in grouped_stacks(stall.diagnosis.stacks):
        lines.append(f"[ddpnb] --- {named(ranks)} ---")
        lines += [f"[ddpnb]   {line}".rstrip() for line in text.splitlines()]
    return "\n".join(lines) + "\n"


def summary_text(record: RunRecord) -> str:
    """A finished run in a few plain lines: the text the dashboard's static summary carries beside its HTML."""
    text = f"[ddpnb] run {record.outcome.value} in {format_duration(record.duration)}\n{summary_table(record)}"
    if record.profile is not None:
        text += "\n" + profile_text(record.profile)
    return f"{text}\nfull per-rank logs: {log_files(record)}" + (f"\n[ddpnb] {record.hint}" if record.hint else "")
