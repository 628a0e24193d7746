"""A run's record as text for the user: the summary table (with the radar's and hardware sampler's columns), where
each rank is at a stall or timeout, an ended attempt's line, a stopped run's line, and the exceptions a run raises,
`WorkerError` and `RunInterrupted`, whose report is that text. Every view words the record through these.
"""

from __future__ import annotations

import time

from ddpnb.core import groups
from ddpnb.core.cellnames import cell_names
from ddpnb.core.failures import Failure, known_cause
from ddpnb.core.record import AttemptRecord, Diagnosis, Outcome, RankRecord, RankState, RankWhere, RunRecord, Stall
from ddpnb.core.stacks import where as stack_place
from ddpnb.core.words import describe_exit, format_duration, size_text, sparkline

TABLE_WIDTH = 120  # characters in a row of the summary table: what a notebook's output shows on one line
LAST_LINE_MIN = 20  # characters of a rank's last line the table keeps, however wide its other columns
_RUNNING = (RankState.STARTING, RankState.RUNNING)


def summary_table(record: RunRecord, ranks: list[int] | None = None) -> str:
    """One row per rank: its state (a failed rank's as its role: 'failed first', 'stopped: peer failed', as the
    dashboard says it), how it exited, its time, the radar's and hardware's columns, its last line. From
    `groups.GROUP_FROM` ranks up, a row per state and the ranks that stand out (`groups.grouped_table`), unless
    `ranks` asks for those ranks' own rows."""
    if ranks is None and groups.grouped(record.world_size):
        return groups.grouped_table(record, lambda r: state_words(record, r), exit_words, straggler_text)
    shown = record.ranks if ranks is None else [record.ranks[rank] for rank in ranks]
    radar = radar_columns(shown)
    states = [state_words(record, r) for r in shown]
    width = max(9, *(len(state) for state in states))
    exits = [exit_words(r) for r in shown]
    exit_width = max(4, *(len(text) for text in exits))
    head = f"{'rank':>4}  {'state':<{width}} {'exit':<{exit_width}} {'time':>10}  {radar[0]}"
    # the last line gets what is left of TABLE_WIDTH (a front end wraps a longer row inside its words)
    last = max(LAST_LINE_MIN, TABLE_WIDTH - len(head))
    rows = [f"{head}last line"]
    for r, state, exit_text, extra in zip(shown, states, exits, radar[1:]):
        shown = r.last_line if len(r.last_line) <= last else r.last_line[: last - 1] + "…"
        rows.append(
            f"{r.rank:>4}  {state:<{width}} {exit_text:<{exit_width}} "
            f"{format_duration(r.duration):>10}  {extra}{shown}".rstrip()
        )
    return "\n".join(rows)


def exit_words(rank: RankRecord) -> str:
    """How the rank exited; nothing for a rank that has ended unreported (the engine's close ended it)."""
    return describe_exit(rank.exitcode) if rank.exitcode is not None or rank.state in _RUNNING else ""


def state_words(record: RunRecord, rank: RankRecord) -> str:
    """The rank's state, a failed rank's as its role in the attempt's failure, a running one's of a stalled run
    as 'stalled'."""
    role = record.failure_role(rank.rank) if rank.state is RankState.FAILED else None
    if record.stalled and rank.state is RankState.RUNNING:
        return "stalled"
    return role.value if role is not None else rank.state.value


def radar_columns(ranks: list[RankRecord]) -> list[str]:
    """The summary table's compute and hardware columns, header first, each padded; none where no rank has data."""
    hardware = [hardware_text(r) for r in ranks]
    cells = [[_compute_text(r) for r in ranks], *([h[i] for h in hardware] for i in range(3))]
    names = ["compute/step", "cpu", "rss", "gpu"]
    shown = [(name, column) for name, column in zip(names, cells) if any(column)]
    widths = [max(len(name), *(len(cell) for cell in column)) for name, column in shown]
    header = "".join(f"{name:<{width}}  " for (name, _), width in zip(shown, widths))
    return [
        header,
        *("".join(f"{column[i]:<{width}}  " for (_, column), width in zip(shown, widths)) for i in range(len(ranks))),
    ]


def _compute_text(rank: RankRecord) -> str:
    compute = rank.compute_per_step
    if compute is None:
        return ""
    straggler = straggler_text(rank)
    return f"{compute * 1000:.1f} ms" + (f" ({straggler})" if straggler else "")


def straggler_text(rank: RankRecord) -> str:
    """'others wait 18 ms a step for it' for a rank the radar flagged, else ''."""
    held = rank.holds_others
    if held is None:
        return ""
    return (
        f"others wait {held * 1000:.0f} ms a step for it"
        if held < 1
        else f"others wait {format_duration(held)} a step for it"
    )


STEADY = 0.01  # resident memory that moved less than this share over the samples shown reads 'steady'


def hardware_text(rank: RankRecord, points: int = 10) -> tuple[str, str, str]:
    """The rank's latest CPU, memory and GPU use as text, each with a sparkline of its last `points` samples
    (CPU on 100% of one core; GPU utilisation on 100%); resident memory's between its lowest and highest sample,
    both said ('1.2 GiB ▁▃▆█ 1.0–1.2 GiB'), or 'steady' when it moved less than 1%. '' where there is no sample."""
    samples = list(rank.hardware)[-points:]
    if not samples:
        return "", "", ""
    last = samples[-1]
    cpu = f"{last.cpu:.0f}% {sparkline([s.cpu for s in samples], max(100.0, *(s.cpu for s in samples)))}"
    low, high = min(s.rss for s in samples), max(s.rss for s in samples)
    rss = (
        f"{size_text(last.rss)} steady"
        if high - low <= STEADY * high
        else f"{size_text(last.rss)} {sparkline([float(s.rss) for s in samples], high, low)} "
        f"{size_text(low)}–{size_text(high)}"
    )
    gpu = ""
    if last.gpu_util is not None:
        gpu = (
            f"{last.gpu_util:.0f}% {sparkline([s.gpu_util or 0.0 for s in samples], 100.0)} "
            f"{size_text(last.gpu_memory or 0)} {last.gpu_power or 0:.0f} W"
        )
    return cpu, rss, gpu


def locals_lines(failure: Failure) -> list[str]:
    """A failure's frames with their locals' reprs, innermost last: `Cell In[5], line 7, in train:` then
    `    step = 3` for each value."""
    lines = []
    for frame in failure.frames:
        if frame.values:
            location = cell_names(f'File "{frame.file}", line {frame.line}')
            lines.append(f"{location}, in {frame.function}:")
            lines.extend(f"    {name} = {text}" for name, text in frame.values)
    return lines


def where_phrase(where: RankWhere, plural: bool = False) -> str:
    """'waits in all_reduce (Cell In[4], line 7)', 'is in time.sleep (...)', 'is at ...' ('wait'/'are')."""
    at = f" ({where.at})" if where.at else ""
    if where.unreported:
        return f"{'have' if plural else 'has'} not reported for {format_duration(where.quiet)}"
    if where.ended:
        return f"{'have' if plural else 'has'} {where.ended}"
    if where.waits_in:
        return f"{'wait' if plural else 'waits'} in {where.waits_in}{at}"
    if where.call:
        return f"{'are' if plural else 'is'} in {where.call}{at}"
    if where.at:
        return f"{'are' if plural else 'is'} at {where.at}"
    # no line of the user's: a stack of ddpnb's or a library's only (the group's rendezvous), or none came
    return f"{'are' if plural else 'is'} {'still starting' if where.starting else 'not in your code'}"


def diagnosis_summary(diagnosis: Diagnosis) -> str:
    """One line, ranks grouped by where they are, those not waiting first: 'rank 1 is in time.sleep (Cell In[4],
    line 6); ranks 0, 2 wait in all_reduce (Cell In[4], line 7)'. From `groups.GROUP_FROM` ranks up, at most
    `groups.MAX_GROUPS` places, the ranks as ranges: 'rank 17 is in time.sleep (...); ranks 0-1023 but 17 wait in
    all_reduce (...)'."""
    world = len(diagnosis.ranks)
    if groups.grouped(world):
        return "; ".join(_place_words(places, world) for places in groups.place_groups(diagnosis))
    by_place: dict[tuple[str, str, str, str, bool, bool], list[int]] = {}
    for where in diagnosis.ranks:
        by_place.setdefault(groups.place_key(where), []).append(where.rank)
    first = {where.rank: where for where in diagnosis.ranks}
    order = sorted(by_place.items(), key=lambda item: (bool(item[0][0]), bool(item[0][1]), item[1][0]))
    return "; ".join(f"{named(ranks)} {where_phrase(first[ranks[0]], len(ranks) > 1)}" for _, ranks in order)


def _place_words(places: list[RankWhere], world: int) -> str:
    ranks = [where.rank for where in places]
    if groups.elsewhere(places):
        return f"{groups.named(ranks, world)} are elsewhere ({len({groups.place_key(w) for w in places})} places)"
    return f"{groups.named(ranks, world)} {where_phrase(places[0], len(ranks) > 1)}"


def diagnosis_lines(diagnosis: Diagnosis, now: float | None = None) -> list[str]:
    """One line per rank with its time since its last activity, as of `now` (`time.time()`; by default when the
    diagnosis was taken): a stall that goes on counts on, since no rank has had any activity meanwhile."""
    later = 0.0 if now is None else max(0.0, now - diagnosis.taken)
    world = len(diagnosis.ranks)
    if groups.grouped(world):  # a line per place, not per rank
        return [
            _place_words(places, world)
            if places[0].unreported and not groups.elsewhere(places)
            else f"{_place_words(places, world)}, {groups.quiet_words(places, later)} since "
            f"{'their' if len(places) > 1 else 'its'} last activity"
            for places in groups.place_groups(diagnosis)
        ]
    return [
        f"rank {w.rank}: {where_phrase(w)}, {format_duration(w.quiet + later)} since its last activity"
        for w in diagnosis.ranks
    ]


def stall_headline(stall: Stall, now: float | None = None) -> str:
    """'stalled: no rank has made progress for 1 min 05 s (threshold 60 s): rank 1 is in time.sleep (...); ...',
    the time as of `now` (`time.time()`; by default when the ranks were last looked at)."""
    quiet = (stall.diagnosis.taken if now is None else now) - stall.since
    return (
        f"stalled: no rank has made progress for {format_duration(quiet)} (threshold {stall.threshold:g} s): "
        f"{diagnosis_summary(stall.diagnosis)}"
    )


def grouped_stacks(stacks: dict[int, str]) -> list[tuple[list[int], str]]:
    """The ranks' stacks with notebook cells named (`Cell In[4], line 7`), each text once for the ranks whose
    stacks read the same, in rank order: [([0, 2], 'Stack ...'), ([1], 'Stack ...')]. From `groups.GROUP_FROM`
    ranks up, one stack (the first rank's) for the ranks at the same place (the collective and the user's line:
    two ranks' stacks differ in thread ids and library lines), the smallest groups past `groups.MAX_GROUPS`
    together."""
    same: dict[str, list[int]] = {}
    texts: dict[str, str] = {}
    grouping = groups.grouped(len(stacks))
    for rank, text in sorted(stacks.items()):
        shown = cell_names(text).rstrip() or "(no stack came)"
        key = stack_place(text) if grouping else shown
        same.setdefault(key, []).append(rank)
        texts.setdefault(key, shown)
    found = sorted(((ranks, texts[key]) for key, ranks in same.items()), key=lambda item: item[0][0])
    if len(found) > groups.MAX_GROUPS:
        largest = sorted(found, key=lambda item: len(item[0]), reverse=True)[: groups.MAX_GROUPS - 1]
        keep = sorted(largest, key=lambda item: item[0][0])
        kept = {id(ranks) for ranks, _ in keep}
        rest = sorted(rank for ranks, _ in found if id(ranks) not in kept for rank in ranks)
        found = [*keep, (rest, f"(elsewhere: {len(found) - len(keep)} places; Run.stacks() has each rank's)")]
    return found


def attempt_line(attempt: AttemptRecord) -> str:
    """'rank 1 failed first: killed by SIGKILL', or the ended attempt's outcome and why."""
    first = attempt.first_failure
    return f"rank {first.rank} failed first: {first.summary}" if first else f"{attempt.outcome.value}: {attempt.note}"


def restart_line(attempt: AttemptRecord, max_restarts: int) -> str:
    """Where a run restarted, as every view marks it in the output: 'attempt 0 failed: rank 1 failed first: ...
    Restarting every rank as fresh processes (restart 1 of 2); logs: rank{N}.attempt0.log (attempt 0), then
    rank{N}.attempt1.log'."""
    ended, next_ = attempt.number, attempt.number + 1
    return (
        f"attempt {ended} failed: {attempt_line(attempt)}. Restarting every rank as fresh processes "
        f"(restart {next_} of {max_restarts}); logs: rank{{N}}.attempt{ended}.log (attempt {ended}), then "
        f"rank{{N}}.attempt{next_}.log"
    )


def log_files(record: RunRecord) -> str:
    """Every rank's log of every attempt, as one path pattern (a shell's brace expansion lists them):
    `<run dir>/rank{0..3}.log`, `<run dir>/rank{0..3}.attempt{0..2}.log` after two restarts."""
    attempts = (
        "" if not record.max_restarts else ".attempt0" if not record.attempt else f".attempt{{0..{record.attempt}}}"
    )
    return f"{record.run_dir}/rank{{0..{record.world_size - 1}}}{attempts}.log"


def named(ranks: list[int]) -> str:
    """'rank 1', 'ranks 0, 2'; from `groups.RANGES_FROM` ranks up as ranges: 'ranks 0-16,18-1023'."""
    if len(ranks) >= groups.RANGES_FROM:
        return f"ranks {groups.ranges(ranks)}"
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))}"


def stopped_line(record: RunRecord) -> str:
    """A stopped run, said as what happened rather than as an error: 'run stopped by the user at 12:01:05, 12 s
    after it started; it has no value (the ranks were stopped before every one had returned)'."""
    note = record.note or "stopped"
    said = note if note.startswith("stopped") else f"stopped ({note})"
    at = time.strftime("%H:%M:%S", time.localtime(record.ended or time.time()))
    return (
        f"run {said} at {at}, {format_duration(record.duration)} after it started; it has no value (the "
        "ranks were stopped before every one had returned)"
    )


class WorkerError(RuntimeError):
    """A run did not succeed. Shows the first failing rank's own traceback, not ddpnb's stack. `summary_above`: it
    is raised under the run's dashboard summary, which has the rank table and where the logs are, so its report
    leaves them out rather than show them twice in one cell."""

    def __init__(self, record: RunRecord, hint: str = "", summary_above: bool = False) -> None:
        self.record = record
        self.hint = hint
        self.summary_above = summary_above
        first = record.first_failure
        self.rank = first.rank if first else None
        headline = (
            f"rank {first.rank} failed first: {first.summary}"
            if first
            else stopped_line(record)
            if record.outcome is Outcome.STOPPED
            else f"run {record.outcome.value}: {record.note}"
        )
        if record.attempts:  # every attempt's first failure, the last one's first
            headline = f"attempt {record.attempt}: {headline}; " + "; ".join(
                f"attempt {a.number}: {attempt_line(a)}" for a in reversed(record.attempts)
            )
        super().__init__(headline)

    def report(self) -> str:
        record = self.record
        first = record.first_failure
        parts = []
        if first is not None:
            again = f" (attempt {record.attempt})" if record.attempts else ""
            parts.append(f"ddpnb: rank {first.rank} of {record.world_size} failed first{again}: {first.summary}")
            if first.traceback:
                shown = cell_names(first.traceback).rstrip()
                parts.append(f"\n--- rank {first.rank} traceback (in the worker) ---\n{shown}")
            meaning = known_cause(first.summary, first.traceback)
            if meaning:
                parts.append(f"ddpnb: {meaning}")
            if any(frame.values for frame in first.frames):
                parts.append(f"\n--- rank {first.rank} locals where it raised ---\n" + "\n".join(locals_lines(first)))
            others = [f for f in sorted(record.failures, key=lambda f: f.time) if f is not first]
            own = [f for f in others if not f.knock_on]  # an error of the rank's own, not a collective's abort
            if own:
                parts.append("\nalso failed:")
                parts.extend(
                    f"  {ranks}: " + ("the same error" if summary == first.summary else summary)
                    for ranks, summary in _by_summary(own, record.world_size)
                )
            if len(own) < len(others):
                parts.append("\nthen, as a consequence:")
                parts.extend(
                    f"  {ranks}: {summary}"
                    for ranks, summary in _by_summary([f for f in others if f.knock_on], record.world_size)
                )
        elif record.outcome is Outcome.STOPPED:
            parts.append(f"ddpnb: {stopped_line(record)}.")
        else:
            parts.append(f"ddpnb: run {record.outcome.value}: {record.note}")
            if record.at_timeout is not None:  # where each rank was, one line each, before the stacks
                parts.append(f"where each rank was: {diagnosis_summary(record.at_timeout)}")
                parts.extend(f"  {line}" for line in diagnosis_lines(record.at_timeout))
                parts.extend(f"  {line}" for line in record.at_timeout.flight)
        if first is None and record.failures:  # ranks that failed because ddpnb stopped the others
            parts.append("\nthen, as a consequence:")
            parts.extend(
                f"  {ranks}: {summary}"
                for ranks, summary in _by_summary(sorted(record.failures, key=lambda f: f.time), record.world_size)
            )
        if record.attempts:
            parts.append(
                f"\nthat was attempt {record.attempt}, the last (--max-restarts {record.max_restarts}); "
                "the earlier ones, each ended by stopping every rank and starting them all again:"
            )
            parts.extend(f"  attempt {a.number}: {attempt_line(a)}" for a in record.attempts)
        if record.internal_errors:
            parts.append(
                "\nddpnb's own errors while it read the ranks (a bug in ddpnb: please report it with the run "
                "directory):"
            )
            parts.extend(record.internal_errors)
        stacks = [r for r in record.ranks if r.stack]
        if stacks and groups.grouped(record.world_size):
            parts.append("\nwhere the ranks were when the run was stopped (one stack for the ranks at one place):")
            for ranks, text in grouped_stacks({r.rank: r.stack for r in stacks}):
                parts.append(f"--- {named(ranks)} ---\n{text}")
        elif stacks:
            parts.append("\nwhere each rank was when the run was stopped:")
            for r in stacks:
                state = (r.stalled_state or r.state).value
                parts.append(
                    f"--- rank {r.rank} ({state}, last line: {r.last_line!r}) ---\n{cell_names(r.stack.rstrip())}"
                )
        if self.summary_above:
            parts.append("\nevery rank's state and its full log: in the summary above")
        else:
            parts.append("\n" + summary_table(record))
            parts.append(f"\nfull per-rank logs: {log_files(record)}")
        if self.hint:
            parts.append(self.hint)
        return "\n".join(parts)

    def __str__(self) -> str:
        return self.report()

    def _render_traceback_(self) -> list[str]:
        # IPython shows these lines instead of the kernel-side stack, which is ddpnb's, not the user's.
        return self.report().splitlines()


def _by_summary(failures: list[Failure], world_size: int) -> list[tuple[str, str]]:
    """('rank 3', summary) for each failure; from `groups.GROUP_FROM` ranks up, once per summary with its ranks."""
    if not groups.grouped(world_size):
        return [(f"rank {f.rank}", f.summary) for f in failures]
    same: dict[str, list[int]] = {}
    for failure in failures:
        same.setdefault(failure.summary, []).append(failure.rank)
    return [(groups.named(ranks, world_size), summary) for summary, ranks in same.items()]


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C or Jupyter's interrupt stopped a run. Still a KeyboardInterrupt (loops and scripts stop as they
    would); in IPython it shows what happened instead of ddpnb's waiting stack."""

    def __init__(self, record: RunRecord, starting: bool = False) -> None:
        self.record = record
        self.starting = starting  # before every rank had started: nothing ran, nothing is kept
        queued = record.queued
        # the ranks' job was cancelled in the queue: no rank ever started
        self.queued = queued is not None and all(rank.pid is None for rank in record.ranks)
        if starting:
            said = "ddpnb: interrupted while the ranks were starting; none is running"
        elif queued is not None and self.queued:
            said = (
                f"ddpnb: interrupted while {queued.what} waited in the queue ({queued.state}); it was cancelled, "
                "and no rank started"
            )
        else:
            said = f"ddpnb: run interrupted after {format_duration(record.duration)}; every rank was stopped"
        super().__init__(said)

    def report(self) -> str:
        if self.starting:
            return (
                f"KeyboardInterrupt: {self.args[0]}.\nRun the cell again when ready (a kernel's first run waits "
                "while ddpnb's worker process imports torch); the kernel and its variables are unchanged."
            )
        if self.queued:
            return f"KeyboardInterrupt: {self.args[0]}.\nThe kernel and its variables are unchanged."
        return "\n".join(
            [
                f"KeyboardInterrupt: {self.args[0]}.",
                "",
                summary_table(self.record),
                "",
                f"full per-rank logs: {log_files(self.record)}",
                "Run the cell again when ready; the kernel and its variables are unchanged.",
            ]
        )

    def _render_traceback_(self) -> list[str]:
        return self.report().splitlines()
