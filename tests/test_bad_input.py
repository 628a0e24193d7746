"""Bad input is refused before anything starts (issue 40), through the API and the magics alike: the error names
the argument and says what to pass, and no run, rank or session was started.

The magics run in this process's IPython `InteractiveShell`, as `%%ddp` parses its flags the same in a kernel
(tests/test_faults.py checks that path through a real one).
"""

from __future__ import annotations

import os
import sys
import textwrap

import cloudpickle
import psutil
import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

import ddpnb
from ddpnb import _session
from ddpnb._magic import DDPMagics, SessionMagics, did_you_mean
from ddpnb.core.failures import known_cause
from ddpnb.core.spec import FEWEST_BOUND, RANKS_PER_CPU
from tests.conftest import private_runs_dir

cloudpickle.register_pickle_by_value(sys.modules[__name__])

# one rank more than the local engine starts without --oversubscribe on this machine
ABOVE_CPUS = max(FEWEST_BOUND, RANKS_PER_CPU * len(os.sched_getaffinity(0))) + 1


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    with private_runs_dir(tmp_path_factory) as path:
        yield path


@pytest.fixture(scope="module")
def shell():
    shell = InteractiveShell.instance()
    shell.register_magics(DDPMagics, SessionMagics)
    return shell


def train(rank):
    return rank


# how each case is passed: a call of the API, or a magic's line (and a %%ddp cell defining `train`)
def run(**options):
    return lambda shell: ddpnb.run(train, view="none", **options)


def session(**options):
    return lambda shell: ddpnb.session(**options)


def line(magic, flags):
    return lambda shell: shell.run_line_magic(magic, flags)


def cell(flags):
    return lambda shell: shell.run_cell_magic("ddp", flags, "def train(rank):\n    return rank\n")


LaunchError = ddpnb.LaunchError
BAD_INPUT = [
    # what is wrong,               passed as,                               refused with, names,         says to pass
    ("nprocs a bool", run(nprocs=True), LaunchError, "nprocs", "nprocs=2"),
    ("gpus a bool", run(gpus=True), LaunchError, "gpus", "gpus=2"),
    ("timeout a bool", run(timeout=True), LaunchError, "timeout", "seconds"),
    ("max_restarts a bool", run(max_restarts=True), LaunchError, "max_restarts", "whole"),
    ("keep_checkpoints a bool", run(keep_checkpoints=True), LaunchError, "keep_checkpoints", "whole"),
    ("stall a bool", run(stall=True), LaunchError, "stall", "--stall 120"),
    ("a session's nprocs a bool", session(nprocs=True), LaunchError, "nprocs", "nprocs=2"),
    ("fold not a bool", run(fold=1), LaunchError, "fold", "True or"),
    ("env a string", run(env="FOO=1"), LaunchError, "env", "env={'FOO': '1'}"),
    ("env name with =", run(env={"A=B": "1"}), LaunchError, "env", "letters, digits"),
    ("env name empty", run(env={"": "1"}), LaunchError, "env", "letters, digits"),
    ("env name with a space", run(env={"A B": "1"}), LaunchError, "env", "letters, digits"),
    ("env value not a string", run(env={"FOO": 1}), LaunchError, "env", "str(1)"),
    ("--env name with NUL", cell("-n 2 --env 'A\0B=1'"), UsageError, "--env", "letters, digits"),
    ("--env name with a space", line("ddp_start", "-n 2 --env 'A B=1'"), UsageError, "--env", "letters, digits"),
    (
        "--timeout on a session",
        line("ddp_start", "-n 2 --timeout 5"),
        UsageError,
        "--timeout",
        "a session takes no --timeout",
    ),
    ("a session's timeout=", session(nprocs=2, timeout=5), LaunchError, "timeout", "this takes"),
    ("more ranks than processes", run(nprocs=100_000, oversubscribe=True), LaunchError, "nprocs", "fewer"),
    ("-n above the process limit", cell("-n 100000"), UsageError, "-n 100000", "fewer"),
    ("more than 8 ranks a CPU", run(nprocs=ABOVE_CPUS), LaunchError, "nprocs", "oversubscribe"),
    (
        "-n above 8 a CPU, session",
        line("ddp_start", f"-n {ABOVE_CPUS}"),
        UsageError,
        f"-n {ABOVE_CPUS}",
        "--oversubscribe",
    ),
]


@pytest.mark.parametrize(
    "passed, error, argument, advice",
    [case[1:] for case in BAD_INPUT],
    ids=[case[0].replace(" ", "-") for case in BAD_INPUT],
)
def test_bad_input_is_refused_naming_the_argument_before_anything_starts(
    shell, runs_dir, passed, error, argument, advice
):
    last_run, current_session, live = ddpnb.last_run(), _session.current_session(), ddpnb.runs()
    runs, processes = set(runs_dir.iterdir()), _descendants()
    try:
        with pytest.raises(error) as info:
            passed(shell)
    finally:  # bad input let through: what it started ends here, so that no later test inherits it
        for started in ddpnb.runs():
            if not any(started is earlier for earlier in live):
                started.stop()
    message = str(info.value)
    assert argument in message and advice in message, message
    assert "did you mean --time?" not in message  # Slurm's flag, for a session on the local engine
    # nothing started: no run recorded, no run directory, no session, no process
    assert ddpnb.last_run() is last_run and _session.current_session() is current_session
    assert set(runs_dir.iterdir()) == runs
    assert _descendants() <= processes


def _descendants() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


def test_unknown_flag_hints_name_only_flags_of_the_engine_in_use():
    ddp, start = DDPMagics.ddp.parser, SessionMagics.ddp_start.parser
    assert did_you_mean(ddp, "-n 2 --tme 5") == " (did you mean --timeout?)"  # local: Slurm's --time is not offered
    assert did_you_mean(ddp, "-n 2 --engine slurm --tme 5") == " (did you mean --time?)"
    assert did_you_mean(start, "-n 2 --tme 5") != " (did you mean --time?)"
    assert did_you_mean(start, "--engine slurm -n 2 --tme 5") == " (did you mean --time?)"
    assert did_you_mean(ddp, "-n 2 --partitio debug") == ""  # Slurm's --partition, without --engine slurm


def test_a_second_ddp_stop_says_there_is_no_session_to_stop(shell, runs_dir, capsys):
    if _session.current_session() is None:  # this process has not started one: nothing to stop, said as such
        with pytest.raises(UsageError, match="no session to stop: none was started in this kernel"):
            shell.run_line_magic("ddp_stop", "")
    shell.run_line_magic("ddp_start", "-n 1")
    shell.run_line_magic("ddp_stop", "")
    assert "[ddpnb] session stopped: its 1 rank has ended" in capsys.readouterr().out
    shell.run_line_magic("ddp_stop", "")
    assert capsys.readouterr().out == (
        "[ddpnb] no session to stop: this kernel's session had ended already "
        "(stopped); %ddp_restart starts it again with its flags, %ddp_start with new "
        "ones\n"
    )


def calls_setsid(rank):
    os.setsid()


SETSID_HINT = "each rank already leads its own session and process group"


def test_setsid_in_a_rank_says_ranks_already_lead_their_own_session(runs_dir):
    with pytest.raises(ddpnb.WorkerError) as info:
        ddpnb.run(calls_setsid, nprocs=1, view="none")
    report = info.value.report()
    assert "PermissionError: [Errno 1] Operation not permitted" in report
    assert f"ddpnb: {SETSID_HINT}" in report and "drop the os.setsid() call" in report, report


def test_a_permission_error_raised_elsewhere_gets_no_setsid_hint():
    def traceback(line: str) -> str:
        return textwrap.dedent(f"""\
            Traceback (most recent call last):
              File "Cell In[3]", line 2, in train
                {line}
            PermissionError: [Errno 1] Operation not permitted""")

    summary = "PermissionError: [Errno 1] Operation not permitted"
    assert SETSID_HINT in known_cause(summary, traceback("os.setsid()"))
    assert known_cause(summary, traceback("os.kill(1, 9)")) == ""
    assert known_cause("PermissionError: [Errno 13] Permission denied", traceback("os.setsid()")) == ""
