"""Mutation check: break the product's guarantees one at a time and see which tests notice.

Each mutant below is plain data: the file it edits (relative to the repository root), the exact snippets it
replaces, and the tests that must fail with it applied. The script applies one mutant, runs its tests with the
repository first on PYTHONPATH, restores the file (always, Ctrl-C included) and prints a table. Not part of CI.

    python scripts/mutants.py                   # every mutant, its tests once
    python scripts/mutants.py --repeat 3        # three runs each: a kill must not depend on a race
    python scripts/mutants.py no-sigkill-escalation first-failure-by-time-only
    python scripts/mutants.py --list
    python scripts/mutants.py --why             # under each mutant, each killing test's failure (the reason)

It refuses to edit a product file with uncommitted changes. When the product code moves, re-target the snippets.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

FAULTS = "tests/test_faults.py::"
CHILDREN = "tests/test_rank_children.py::"
MAGIC = "tests/test_magic.py::"
CHILD_PATHS = "test_what_a_rank_started_is_gone_after_the_run_however_it_ended"
STALL = "tests/test_stall.py::"
RESTARTS = "tests/test_restarts.py::"
DATA = "tests/test_data.py::"
SESSION = "tests/test_session.py::"
FOLD = "tests/test_fold.py::"
RESTART_FROM_CHECKPOINT = RESTARTS + "test_a_failed_rank_restarts_the_group_from_the_last_checkpoint[raise]"
ON_FAKE = "tests/test_run_on_fake.py::"
TEARDOWN_STOP = (
    ON_FAKE + "test_stop_during_a_failed_attempts_teardown_never_restarts",
    ON_FAKE + "test_an_interrupt_during_a_failed_attempts_teardown_never_restarts",
)
COMPLETE_CHECKPOINT = RESTARTS + "test_only_a_step_directory_holding_its_metadata_is_a_complete_checkpoint"
CUDA_DEVICE = DATA + "test_a_notebook_cuda_tensor_goes_onto_its_ranks_own_device_once_that_is_set_up"
SLURM = "tests/test_slurm.py::"
RAY = "tests/test_ray.py::"
RAY_DETACHED_SIGKILL = (
    "tests/test_ray_detached.py::"
    "test_a_detached_ray_training_outlives_its_kernels_sigkill_and_a_fresh_kernel_attaches_by_name"
)
SLURM_DETACHED_KERNEL_SIGKILL = (
    "tests/test_slurm_detached.py::"
    "test_a_detached_slurm_training_outlives_its_kernels_sigkill_and_a_new_kernel_collects_its_result"
)
DETACHED_STANDBY = (
    "tests/test_detached.py::"
    "test_the_next_detached_launch_goes_to_a_standby_that_ordinary_runs_spare_and_that_ends_with_its_kernel"
)
RAY_CLIENT_SIGKILL = (
    "tests/test_ray_client.py::"
    "test_a_detached_training_launched_through_ray_client_outlives_its_kernel_and_a_fresh_client_attaches"
)
DEBUGGER = "tests/test_debugger.py::"
VIEWS = "tests/test_first_hour_views.py::"
NEWCOMER = "tests/test_newcomer.py::"
BAD_INPUT = "tests/test_bad_input.py::test_bad_input_is_refused_naming_the_argument_before_anything_starts"
STALL_MARKED = STALL + "test_rank_sleeping_before_all_reduce_is_named_and_the_others_wait_in_it_then_the_run_succeeds"


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    edits: tuple[tuple[str, str], ...]  # (exact old snippet, new snippet); each old snippet occurs once
    tests: tuple[str, ...]  # pytest node ids that must kill it


MUTANTS = [
    Mutant(
        "no-sigkill-escalation",
        "ddpnb/node/forked.py",
        (("                self._signal(rank, signal.SIGKILL)\n", "                pass\n"),),
        (FAULTS + "test_rank_ignoring_sigterm_is_killed_after_the_grace_period",),
    ),
    # "kill-the-rank-not-its-group" and "exited-ranks-group-left-running" retired: what a rank started in its
    # group is also ended as the rank's orphan since issue 40 (node/orphans.py), which the two below pin
    Mutant(
        "authkey-in-every-ranks-environment",
        "ddpnb/node/rank.py",
        (
            (
                "    os.environ.update(_torchrun_env(seat, spec))\n",
                (
                    "    os.environ.update(_torchrun_env(seat, spec))\n"
                    "    os.environ['DDPNB_KEY'] = bytes(__import__('multiprocessing').current_process().authkey).hex()\n"
                ),
            ),
        ),
        (FAULTS + "test_no_secret_reaches_a_ranks_environment_and_env_values_reach_every_rank",),
    ),
    Mutant(
        "spec-args-in-every-ranks-environment",
        "ddpnb/node/rank.py",
        (
            (
                "    os.environ.update(_torchrun_env(seat, spec))\n",
                "    os.environ.update(_torchrun_env(seat, spec))\n    os.environ['DDPNB_ARGS'] = repr(spec.args)\n",
            ),
        ),
        (FAULTS + "test_no_secret_reaches_a_ranks_environment_and_env_values_reach_every_rank",),
    ),
    Mutant(
        "first-failure-by-time-only",
        "ddpnb/core/failures.py",
        (("min(failures, key=lambda f: (f.knock_on, f.time))", "min(failures, key=lambda f: f.time)"),),
        (FAULTS + "test_root_cause_is_on_top_even_when_a_knock_on_failure_came_first",),
    ),
    Mutant(
        "is-knock-on-always-false",
        "ddpnb/core/failures.py",
        (("    if exc_type in _KNOCK_ON_TYPES:\n        return True\n", "    return False\n"),),
        (
            FAULTS + "test_collective_errors_of_gloo_and_nccl_are_knock_on_failures",
            FAULTS + "test_what_gloo_raises_when_a_peer_is_killed_is_a_knock_on_failure",
        ),
    ),
    Mutant(
        "own-error-read-after-the-stop-is-a-consequence",
        "ddpnb/core/attempt.py",
        (
            (
                '        knock_on = is_knock_on(message.exc_type, message.message) or message.time >= self._stopping.get(\n            rank, float("inf")\n        )\n',
                "        knock_on = is_knock_on(message.exc_type, message.message) or rank in self._stopping\n",
            ),
        ),
        (FAULTS + "test_the_same_error_on_every_rank_is_listed_as_also_failed_not_as_a_consequence",),
    ),
    Mutant(
        "stopped-rank-log-has-no-ending",
        "ddpnb/core/ranklogs.py",
        (
            (
                "            if rank.state is RankState.FINISHED:\n                continue\n",
                "            if rank.state in (RankState.FINISHED, RankState.STOPPED):\n                continue\n",
            ),
        ),
        (FAULTS + "test_rank_ignoring_sigterm_is_killed_after_the_grace_period",),
    ),
    Mutant(
        "hardware-samples-count-as-progress",
        "ddpnb/core/attempt.py",
        (
            (
                "            self.record.ranks[rank].hardware.append(message)\n",
                "            self.record.ranks[rank].hardware.append(message)\n            self.watchdog.stamp(rank)\n",
            ),
        ),
        (STALL + "test_rank_sleeping_before_all_reduce_is_named_and_the_others_wait_in_it_then_the_run_succeeds",),
    ),
    Mutant(
        "a-stops-consequence-heads-the-report",
        "ddpnb/core/failures.py",
        (
            (
                "    return None if first is not None and first.knock_on and ended_by_ddpnb else first\n",
                "    return first\n",
            ),
        ),
        (FAULTS + "test_a_timeout_whose_only_failures_are_its_consequences_says_timed_out_first",),
    ),
    Mutant(
        "function-also-called-in-the-kernel",
        "ddpnb/_magic.py",
        (("        result = run.result()\n", "        fn()\n        result = run.result()\n"),),
        (MAGIC + "test_the_cells_function_runs_once_on_each_rank_and_never_in_the_kernel",),
    ),
    # --- restarts ----------------------------------------------------------------------------------------------------
    Mutant(
        "stop-during-a-failed-teardown-restarts",
        "ddpnb/core/policy.py",
        (
            (
                "        return 0 if stop_asked else max(0, self.max_restarts - number)",
                "        return max(0, self.max_restarts - number)",
            ),
        ),
        TEARDOWN_STOP,
    ),
    Mutant(
        "restart-budget-one-short",
        "ddpnb/core/policy.py",
        (("else max(0, self.max_restarts - number)", "else max(0, self.max_restarts - number - 1)"),),
        (RESTART_FROM_CHECKPOINT,),
    ),
    Mutant(
        "a-restart-loads-no-checkpoint",
        "ddpnb/rank/checkpoint.py",
        (
            (
                "        own = [found for found in (_engine_latest(), latest(spec.checkpoint_dir)) if found is not None]\n",
                "        own = []\n",
            ),
        ),
        (RESTART_FROM_CHECKPOINT,),
    ),
    # --- checkpoints -------------------------------------------------------------------------------------------------
    Mutant(
        "partial-checkpoint-counts-as-complete",
        "ddpnb/core/checkpoints.py",
        (("if (match := COMPLETE.fullmatch(name))", "if (match := COMPLETE.match(name))"),),
        (COMPLETE_CHECKPOINT,),
    ),
    Mutant(
        "checkpoint-without-metadata-counts-as-complete",
        "ddpnb/core/checkpoints.py",
        (
            (
                '    found = [\n        (int(match.group(1)), Path(root, name))\n        for name in names\n        if (match := COMPLETE.fullmatch(name)) and Path(root, name, ".metadata").is_file()\n    ]\n',
                "    found = [(int(match.group(1)), Path(root, name)) for name in names if (match := COMPLETE.fullmatch(name))]\n",
            ),
        ),
        (COMPLETE_CHECKPOINT,),
    ),
    Mutant(  # killed only by accident before: the mid-save kill matched `step-000000020.` alone
        "checkpoint-written-in-place",
        "ddpnb/rank/checkpoint.py",
        (
            (
                '    partial = root / f"{step_dir(step)}.attempt{spec.attempt}{PARTIAL_SUFFIX}"\n',
                "    partial = final\n",
            ),
            ("    if final.exists():  # the same step saved again", "    if final != partial and final.exists():  #"),
        ),
        (RESTARTS + "test_a_rank_killed_inside_a_save_leaves_only_a_partial_directory_for_that_step",),
    ),
    Mutant(
        "old-checkpoints-never-pruned",
        "ddpnb/rank/checkpoint.py",
        (("    stale = [name for _, name in complete[:-keep]] if keep > 0 else []\n", "    stale = []\n"),),
        (RESTART_FROM_CHECKPOINT, RESTARTS + "test_checkpoints_go_under_checkpoint_dir_one_directory_per_run"),
    ),
    # --- retention ---------------------------------------------------------------------------------------------------
    Mutant(
        "retention-deletes-a-live-run",
        "ddpnb/core/rundir.py",
        (("if p.is_dir() and not p.is_symlink() and not in_use(p))", "if p.is_dir() and not p.is_symlink())"),),
        (FAULTS + "test_retention_keeps_the_newest_runs_and_never_a_live_one",),
    ),
    Mutant(
        "retention-keeps-one-run-too-many",
        "ddpnb/core/rundir.py",
        (("ended[: max(0, len(ended) - KEEP_RUNS + 1)]", "ended[: max(0, len(ended) - KEEP_RUNS)]"),),
        (FAULTS + "test_retention_keeps_the_newest_runs_and_never_a_live_one",),
    ),
    Mutant(
        "resumed-run-directory-not-held",
        "ddpnb/core/checkpoints.py",
        (('    if checkpoint_dir.name != "checkpoints":\n        return None\n', "    return None\n"),),
        (RESTARTS + "test_the_run_directory_a_run_resumes_from_is_kept_by_retention_while_the_run_lives",),
    ),
    # --- notebook data -----------------------------------------------------------------------------------------------
    Mutant(
        "notebook-cuda-tensors-all-on-cuda-0",
        "ddpnb/rank/data.py",
        (("        tensor.data = tensor.data.to(_device)\n", '        tensor.data = tensor.data.to("cuda:0")\n'),),
        (CUDA_DEVICE + "[cuda:1]", CUDA_DEVICE + "[cuda:3]"),
    ),
    Mutant(
        "cuda-tensors-unpickled-early-never-moved",
        "ddpnb/rank/data.py",
        (("    while _pending:\n        _move(_pending.pop())\n", "    _pending.clear()\n"),),
        (CUDA_DEVICE + "[cuda:1]",),
    ),
    Mutant(  # nearly equivalent before: the next launch's `keep` drops dead sources too; the test looks before one
        "released-tensors-copy-kept-until-the-next-launch",
        "ddpnb/node/shared.py",
        (
            (
                "            ref = weakref.ref(source, lambda ref, key=key, target=self.store: target.forget(key, ref))\n",
                "            ref = weakref.ref(source)\n",
            ),
        ),
        (DATA + "test_a_released_tensors_copy_goes_away_and_nothing_is_left_after_a_failed_pickle",),
    ),
    Mutant(
        "unchanged-data-written-again",
        "ddpnb/node/shared.py",
        (("        block = self.store.find(key, source)\n", "        block = None\n"),),
        (DATA + "test_unchanged_data_is_not_written_again_and_a_change_in_the_notebook_is",),
    ),
    Mutant(
        "tensor-changed-in-place-not-sent-again",
        "ddpnb/node/shared.py",
        (
            (
                "        if block is not None and (\n            block.version == version if version is not None else block.segment.same(block.offset, data())\n        ):\n",
                "        if block is not None and (True if version is not None else block.segment.same(block.offset, data())):\n",
            ),
        ),
        (DATA + "test_unchanged_data_is_not_written_again_and_a_change_in_the_notebook_is",),
    ),
    # --- sessions ----------------------------------------------------------------------------------------------------
    Mutant(
        "session-cells-run-in-a-fresh-namespace",
        "ddpnb/rank/session.py",
        (
            (
                "        reply = _answer(rank, command, namespace)\n",
                "        reply = _answer(rank, command, dict(namespace))\n",
            ),
        ),
        (SESSION + "test_state_survives_across_cells_and_values_come_back_per_rank",),
    ),
    Mutant(
        "session-error-drops-the-namespace",
        "ddpnb/rank/session.py",
        (
            (
                "            _last_error = exc\n        return msg.Reply(\n",
                "            _last_error = exc\n        namespace.clear()\n        return msg.Reply(\n",
            ),
        ),
        (SESSION + "test_an_error_on_one_rank_shows_its_traceback_and_keeps_every_namespace",),
    ),
    Mutant(
        "session-push-lands-nowhere",
        "ddpnb/rank/session.py",
        (("        namespace.update(command.values)\n", "        dict(namespace).update(command.values)\n"),),
        (SESSION + "test_push_pull_and_call_from_python",),
    ),
    # --- folding -----------------------------------------------------------------------------------------------------
    Mutant(
        "a-line-waits-for-every-rank",
        "ddpnb/views/fold.py",
        (
            (
                "            if len(folded.ranks) < self.world_size and now - folded.opened < self.window:",
                "            if len(folded.ranks) < self.world_size:",
            ),
        ),
        (FOLD + "test_a_line_some_ranks_print_waits_only_for_the_window",),
    ),
    Mutant(
        "a-rank-repeating-a-line-folds-into-it",
        "ddpnb/views/fold.py",
        (
            (
                "            number = max(same.next_for.get(line.rank, 0), same.first)\n",
                "            number = same.first\n",
            ),
        ),
        (FOLD + "test_a_rank_repeating_a_line_is_two_lines_not_one",),
    ),
    Mutant(
        "stdout-and-stderr-fold-together",
        "ddpnb/views/fold.py",
        (
            (
                r'            key = (line.stream, GLOG_TIME.sub(r"[\1 ", text))' + "\n",
                r'            key = (Stream.STDOUT, GLOG_TIME.sub(r"[\1 ", text))' + "\n",
            ),
            (
                r'            key = (folded.stream, GLOG_TIME.sub(r"[\1 ", folded.text))' + "\n",
                r'            key = (Stream.STDOUT, GLOG_TIME.sub(r"[\1 ", folded.text))' + "\n",
            ),
        ),
        (FOLD + "test_stdout_and_stderr_fold_apart",),
    ),
    # --- stall -------------------------------------------------------------------------------------------------------
    Mutant(
        "stall-zero-still-watches",
        "ddpnb/core/stall.py",
        (("        return self.fixed != 0\n", "        return True\n"),),
        (
            ON_FAKE + "test_stall_zero_never_marks_the_run_stalled",
            STALL + "test_timeout_report_starts_with_where_each_rank_is",
        ),
    ),
    Mutant(
        "stall-marked-before-its-threshold",
        "ddpnb/core/watchdog.py",
        (
            (
                "        if quiet <= self.stall.threshold() or not any(",
                "        if quiet <= self.stall.threshold() / 2 or not any(",
            ),
        ),
        (STALL_MARKED,),
    ),
    Mutant(
        "stall-never-resumes",
        "ddpnb/core/attempt.py",
        (("            self.record.stall.resumed = self.clock()\n", "            pass\n"),),
        (STALL_MARKED,),
    ),
    # --- the slurm engine (test_slurm.py: a real two-node Slurm) -----------------------------------------------------
    Mutant(
        "slurm-rank-named-without-its-node",
        "ddpnb/engines/slurm/engine.py",
        (('self._seats, where="Slurm node")', 'self._seats, where="")'),),
        (SLURM + "test_a_rank_killed_on_node_2_is_named_and_every_rank_and_the_step_are_gone",),
    ),
    Mutant(
        "lost-slurm-node-not-named",
        "ddpnb/engines/slurm/engine.py",
        (('f"its Slurm node {link.name} was lost (ddpnb\'s host there ended{how})",', 'f"ended ({how})",'),),
        (SLURM + "test_a_node_lost_mid_run_is_named_as_the_root_cause_and_nothing_is_left",),
    ),
    Mutant(
        "slurm-data-pickled-for-every-rank",
        "ddpnb/engines/slurm/engine.py",
        (
            (
                "        return MemoryShipment()  # memory files in the kernel",
                "        return None  # memory files in the kernel",
            ),
        ),
        (SLURM + "test_notebook_data_reaches_each_node_once_and_every_rank_maps_its_nodes_copy",),
    ),
    Mutant(
        "slurm-unchanged-push-sent-again",
        "ddpnb/remote/connections.py",
        (("lacking = {segment: files[segment] for segment in link.holdings.lacks(files)}", "lacking = dict(files)"),),
        (SLURM + "test_notebook_data_reaches_each_node_once_and_every_rank_maps_its_nodes_copy",),
    ),
    Mutant(
        "slurm-host-without-setup-waits-forever",
        "ddpnb/remote/connections.py",
        (
            (
                "                if link.conn is not None and link.closed_at is None:\n                    self._hang_up(link)\n",
                "",
            ),
            (
                "            if (\n                link.conn is not None\n                and link.closed_at is None\n                and not (link.ready and _send(link, Control.ESCALATE, wait=False))\n            ):\n                self._hang_up(link)\n",
                "            if link.ready:\n                _send(link, Control.ESCALATE, wait=False)\n",
            ),
            ("        return all(link.hello is not None for link in self.links)\n", "        return True\n"),
        ),
        (
            SLURM + "test_a_run_stopped_while_node_0s_host_is_late_ends_with_nothing_left",
            SLURM + "test_a_run_stopped_at_any_moment_of_its_start_ends_with_nothing_left",
        ),
    ),
    Mutant(
        "slurm-door-checks-one-connection-at-a-time",
        "ddpnb/remote/door.py",
        (("            check.start()\n", "            check.run()\n"),),  # a silent stranger holds the hosts up
        (SLURM + "test_a_connection_without_the_runs_secret_is_refused_and_the_run_goes_on",),
    ),
    Mutant(
        "stacks-answer-reads-the-next-requests-number",
        "ddpnb/remote/host.py",
        (
            (
                '                threading.Thread(\n                    target=self._send_stacks, args=value, name=f"ddpnb-{self.place.engine}-stacks", daemon=True\n',
                '                ranks, number = value\n                threading.Thread(\n                    target=lambda: self.report(Report.STACKS, (number, self.ranks.collect_stacks(ranks))),\n                    name="ddpnb-slurm-stacks",\n                    daemon=True,\n',
            ),
        ),
        (
            "tests/test_remote.py::test_each_stacks_request_is_answered_under_its_own_number_when_the_next_comes_at_once",
        ),
    ),
    Mutant(
        "slurm-step-never-tried-again",
        "ddpnb/engines/slurm/step.py",
        (("        return self.done_at is not None and self._retry(now)\n", "        return False\n"),),
        (SLURM + "test_a_step_slurms_messaging_failed_to_create_is_started_again_saying_so",),
    ),
    Mutant(
        "slurm-command-never-asked-again",
        "ddpnb/engines/slurm/allocation.py",
        (("        if retry == RETRIES or not transient(said):\n", "        if True:\n"),),
        (SLURM + "test_a_step_slurms_messaging_failed_to_create_is_started_again_saying_so",),
    ),
    Mutant(
        "queue-wait-counts-toward-the-timeout",
        "ddpnb/core/attempt.py",
        (
            (
                "            held=bool(self.broker.waiting) or self.is_queued(),\n",
                "            held=bool(self.broker.waiting),\n",
            ),
        ),
        (SLURM + "test_outside_an_allocation_a_background_run_queues_with_no_clock_running_and_stop_cancels_its_job",),
    ),
    Mutant(
        "stop-ignored-while-the-job-waits-in-the-queue",
        "ddpnb/engines/slurm/engine.py",
        (
            (
                "            while not self._conns.stopping and not job.granted_within(submit.POLL):\n",
                "            while not job.granted_within(submit.POLL):\n",
            ),
        ),
        (
            SLURM + "test_outside_an_allocation_a_background_run_queues_with_no_clock_running_and_stop_cancels_its_job",
            SLURM + "test_an_interrupt_while_the_job_waits_in_the_queue_cancels_it_and_starts_nothing",
        ),
    ),
    Mutant(
        "queued-job-outlives-its-kernel",
        "ddpnb/engines/slurm/submit.py",
        (
            (
                '[sys.executable, "-I", KEEPER, *self.request.salloc(salloc_path())]',
                "self.request.salloc(salloc_path())",
            ),
        ),
        (SLURM + "test_a_job_asked_for_by_a_kernel_that_dies_goes_back_with_it[in the queue]",),
    ),
    Mutant(
        "own-job-never-given-back",
        "ddpnb/engines/slurm/submit.py",
        (("        salloc = self._salloc\n        if salloc is None:\n            return\n", "        return\n"),),
        (SLURM + "test_outside_an_allocation_a_run_asks_for_its_own_job_says_its_queue_state_and_gives_it_back",),
    ),
    Mutant(
        "own-job-outlives-its-kernel",
        "ddpnb/engines/slurm/submit.py",
        (('*self._job_options(), "cat"]', '*self._job_options(), "sleep", "3600"]'),),
        (SLURM + "test_a_job_asked_for_by_a_kernel_that_dies_goes_back_with_it",),
    ),
    # --- the ray engine's warm launch (test_ray.py: a real local Ray instance) ------------------------------------
    Mutant(
        "lost-host-fails-no-rank",
        "ddpnb/engines/ray/warm.py",
        (("        self._hosts.lose(\n", "        (lambda *_: None)(\n"),),
        (RAY + "test_a_lost_host_fails_its_ranks_with_rays_own_line_and_the_next_launch_gets_a_new_one",),
    ),
    Mutant(
        "placement-group-kept-after-the-run",
        "ddpnb/engines/ray/warm.py",
        (("                _remove(self._group, self.spec.world_size)\n", "                pass\n"),),
        (RAY + "test_a_killed_ray_rank_is_named_as_the_first_failure_and_nothing_is_left",),
    ),
    Mutant(
        "preload-never-reaches-the-hosts",
        "ddpnb/engines/ray/warm.py",
        (
            (
                "                    self._run,\n                    self._payload,\n                    seats[node],\n                    self._refs,\n                    self._commands,\n                    forkserver.preloaded(),\n                    versions(),\n",
                "                    self._run, self._payload, seats[node], self._refs, self._commands, [], versions()\n",
            ),
        ),
        (RAY + "test_a_module_preloaded_in_the_kernel_is_in_every_ray_rank_from_the_next_launch",),
    ),
    # --- a detached run's supervisor on Ray (test_ray_detached.py: a real local Ray instance) ---------------------
    Mutant(
        "ray-supervisor-owned-by-the-kernel",
        "ddpnb/engines/ray/detach.py",
        (('                lifetime="detached",  # not the kernel\'s: it stays when the kernel goes\n', ""),),
        (RAY_DETACHED_SIGKILL,),
    ),
    Mutant(
        "ray-supervisor-stays-after-the-run",
        "ddpnb/engines/ray/detach.py",
        (("        ray.actor.exit_actor()\n", "        pass\n"),),
        (RAY_DETACHED_SIGKILL,),
    ),
    # --- a detached run's supervisor on Slurm (test_slurm_detached.py: the real two-node Slurm) -----------------
    Mutant(
        "queued-slurm-run-not-listed",
        "ddpnb/detached/supervisor.py",
        (("        files.write_unless_there(run_dir / files.MARKER, _marker(plan))\n", ""),),
        (SLURM_DETACHED_KERNEL_SIGKILL,),
    ),
    Mutant(
        "attach-to-a-queued-run-does-not-wait",
        "ddpnb/detached/attach.py",
        (("    _out_of_queue(found)\n", ""),),
        (SLURM_DETACHED_KERNEL_SIGKILL,),
    ),
    # --- a detached run's supervisor on this machine (test_detached.py) -------------------------------------------
    Mutant(
        "orphan-sweep-ends-a-live-supervisor",
        "ddpnb/node/forked.py",
        (("_running | forkserver.spared())", "_running)"),),
        (DETACHED_STANDBY,),
    ),
    Mutant(
        "standby-let-go-without-waiting",
        "ddpnb/detached/supervisor.py",
        (("forkserver.spare(process.pid, self.let_go)", "forkserver.spare(process.pid, self.conn.close)"),),
        ("tests/test_preload.py::test_preload_after_a_detached_launch_ends_the_standby_supervisor_and_goes_through",),
    ),
    Mutant(
        "ray-served-supervisor-stays-once-collected",
        "ddpnb/engines/ray/detach.py",
        (("        self._collected.set()\n", "        pass\n"),),
        (RAY_CLIENT_SIGKILL,),
    ),
    # --- the debugger in the cell and what a failure keeps (issues 28, 29) ----------------------------------------
    Mutant(
        "time-at-a-prompt-counts-toward-the-timeout",
        "ddpnb/core/watchdog.py",
        (("        if held:\n            self._held_at", "        if False:\n            self._held_at"),),
        (DEBUGGER + "test_a_breakpoint_on_rank_1_prompts_in_the_cell_and_neither_times_out_nor_stalls[breakpoint()]",),
    ),
    Mutant(
        "failure-locals-dropped",
        "ddpnb/core/stacks.py",
        (("    return tuple(frames[-LOCALS_FRAMES:])", "    return ()"),),
        (VIEWS + "test_the_first_failures_locals_are_kept_in_the_record_and_shown_under_its_traceback",),
    ),
    Mutant(
        "stacks-keep-ddpnbs-threads",
        "ddpnb/core/stacks.py",
        (
            (
                "        if all(_library(file) for file, _, _ in frames):\n            left += 1\n            continue\n",
                "",
            ),
        ),
        (VIEWS + "test_run_stacks_read_like_a_traceback_naming_the_cell_with_its_source",),
    ),
    Mutant(
        "dashboard-widgets-not-closed",
        "ddpnb/views/dashboard.py",
        (("                close_all(self.widget)\n", "                pass\n"),),
        (
            (
                "tests/test_dashboard.py::"
                "test_a_finished_runs_widgets_are_all_closed_and_its_summary_stays_whatever_ended_it"
            ),
        ),
    ),
    Mutant(
        "restart-line-names-only-the-next-attempts-logs",
        "ddpnb/core/report.py",
        (
            (
                '        f"(restart {next_} of {max_restarts}); logs: rank{{N}}.attempt{ended}.log (attempt {ended}), then "\n        f"rank{{N}}.attempt{next_}.log"\n',
                '        f"(restart {next_} of {max_restarts}); logs: rank{{N}}.attempt{next_}.log"\n',
            ),
        ),
        (RESTARTS + "test_a_restarted_runs_text_names_every_attempts_logs",),
    ),
    Mutant(
        "preload-hint-falls-back-to-every-new-package",
        "ddpnb/rank/main.py",
        (
            (
                "            }\n        )\n",
                '            }\n            or {name for name in installed if not name.startswith("_")}\n        )\n',
            ),
        ),
        (
            (
                "tests/test_preload.py::"
                "test_the_hint_names_only_modules_the_functions_pickle_names_not_what_they_import_in_turn"
            ),
        ),
    ),
    Mutant(
        "background-breakpoint-skipped",
        "ddpnb/_api.py",
        (
            (
                "    prompts = engine_type.capabilities.commands and",
                "    prompts = foreground and engine_type.capabilities.commands and",
            ),
        ),
        (DEBUGGER + "test_a_background_runs_breakpoint_is_answered_from_a_later_cell_with_debug",),
    ),
    Mutant(
        "debug-in-the-kernel-opens-ddpnbs-frames",
        "ddpnb/__init__.py",
        (("    point_debug_at_the_ranks(ipython)\n", ""),),
        (DEBUGGER + "test_debug_in_the_kernel_after_a_failed_run_points_at_the_ranks_frames",),
    ),
    Mutant(
        "debug-opens-a-post-mortem-on-a-knock-on",
        "ddpnb/rank/main.py",
        (
            (
                "        if (\n            context.spec is not None\n            and context.spec.debug\n            and not isinstance(exc, KeyboardInterrupt)\n            and not is_knock_on(type(exc).__name__, str(exc))\n        ):\n",
                "        if context.spec is not None and context.spec.debug and not isinstance(exc, KeyboardInterrupt) and True:\n",
            ),
        ),
        (DEBUGGER + "test_debug_asks_only_the_rank_that_failed_first[knock-on]",),
    ),
    Mutant(
        "a-stopping-run-asks-a-ranks-prompt",
        "ddpnb/core/attempt.py",
        (
            (
                "        if self._stop is not None:  # every rank is being stopped",
                "        if False:  # every rank is being stopped",
            ),
            ("        self.broker.withdraw(going)  # a rank being stopped", "        # a rank being stopped"),
        ),
        (DEBUGGER + "test_debug_asks_only_the_rank_that_failed_first[own-error]",),
    ),
    Mutant(
        "a-straggler-verdict-bug-ends-the-run",
        "ddpnb/core/attempt.py",
        (
            (
                '        with self._aside(None, "judge the stragglers"):\n            self.watchdog',
                "        if True:\n            self.watchdog",
            ),
        ),
        (FAULTS + "test_a_bug_in_the_straggler_verdict_is_said_once_and_the_run_goes_on",),
    ),
    Mutant(
        "a-short-log-write-loses-the-rest-silently",
        "ddpnb/core/ranklogs.py",
        (("            while view:  # a write", "            if view:  # a write"),),
        (FAULTS + "test_a_log_the_disk_cannot_take_is_cut_short_and_the_run_goes_on",),
    ),
    Mutant(
        "a-host-lost-while-it-forks-is-a-ray-failure",
        "ddpnb/engines/ray/warm.py",
        (
            (
                "            except ray.exceptions.RayActorError as exc:\n                self._host_lost(node, exc)\n",
                "            except ZeroDivisionError as exc:\n                self._host_lost(node, exc)\n",
            ),
        ),
        (RAY + "test_a_host_lost_while_it_forks_the_ranks_fails_them_saying_so_and_the_next_launch_gets_a_new_one",),
    ),
    Mutant(
        "an-unwritable-trace-is-said-as-no-profile",
        "ddpnb/core/profile.py",
        (
            (
                "            except OSError as exc:  # the disk's doing",
                "            except ZeroDivisionError as exc:  # the disk's doing",
            ),
        ),
        (FAULTS + "test_a_profile_the_disk_cannot_take_says_why_each_trace_is_missing_and_the_run_goes_on",),
    ),
    Mutant(
        "a-ranks-cells-syntax-error-goes-to-every-rank",
        "ddpnb/_session.py",
        (
            (
                '        ast.parse(code, filename or "<session cell>")  # a syntax error',
                '        # ast.parse(code, filename or "<session cell>")  # a syntax error',
            ),
        ),
        ("tests/test_session.py::test_a_syntax_error_in_a_ranks_cell_is_shown_as_python_shows_it_and_reaches_no_rank",),
    ),
    Mutant(
        "an-unpicklable-push-is-a-bare-pickling-error",
        "ddpnb/core/pickling.py",
        (("        if command.values:\n", "        if False:\n"),),
        ("tests/test_session.py::test_push_pull_and_call_from_python",),
    ),
    Mutant(
        "a-nodes-relay-holds-without-bound",
        "ddpnb/node/relay.py",
        (("            self.lock.wait_for(lambda: self._ready_bytes < self.hold_bytes or self.abandoned)\n", ""),),
        ("tests/test_engines.py::test_a_nodes_relay_holds_its_reader_back_once_the_kernel_falls_behind",),
    ),
    Mutant(
        "a-line-for-a-prompt-gone-meanwhile-vanishes-silently",
        "ddpnb/views/frontend.py",
        (
            (
                "        sent = run.answer(prompt, line)\n        if not sent:\n            print(\n",
                "        sent = run.answer(prompt, line)\n        if False:\n            print(\n",
            ),
        ),
        (DEBUGGER + "test_a_line_typed_at_a_prompt_the_run_ended_meanwhile_is_not_sent_and_that_is_said",),
    ),
    Mutant(
        "a-views-bug-costs-the-cell-its-result",
        "ddpnb/core/announce.py",
        (
            (
                "            except Exception as exc:  # noqa: BLE001 - a view's bug",
                "            except ZeroDivisionError as exc:  # noqa: BLE001 - a view's bug",
            ),
        ),
        (FAULTS + "test_a_bug_in_a_view_is_said_once_and_the_run_keeps_its_result_and_its_end",),
    ),
    Mutant(
        "a-callers-error-shows-ddpnbs-frames",
        "ddpnb/core/stacks.py",
        (
            (
                "            *traceback.format_list(traceback.extract_tb(to_the_callers(tb))),\n",
                "            *traceback.format_list(traceback.extract_tb(tb)),\n",
            ),
        ),
        ("tests/test_core.py::test_logging_something_that_is_not_a_number_names_it_raised_on_the_users_line",),
    ),
    Mutant(
        "debug-of-a-callers-error-opens-in-ddpnb",
        "ddpnb/rank/debug.py",
        (("        tb = to_the_callers(tb)\n", "        pass\n"),),
        (DEBUGGER + "test_debug_of_an_error_about_a_ddpnb_call_opens_at_the_users_line",),
    ),
    Mutant(
        "checkpoint-directory-sharing-unchecked",
        "ddpnb/rank/checkpoint.py",
        (("    _check_shared(root, token)\n", ""),),
        (RESTARTS + "test_a_checkpoint_directory_a_rank_does_not_share_is_refused_at_the_first_save",),
    ),
    Mutant(
        "slurm-job-never-kept-for-the-next-launch",
        "ddpnb/engines/slurm/engine.py",
        (("            self._own_job.park()\n", "            self._own_job.release()\n"),),
        (SLURM + "test_outside_an_allocation_a_sessions_restart_keeps_its_job_and_its_end_gives_it_back",),
    ),
    # --- the straggler radar: who the others wait for (issue 28) -------------------------------------------------
    Mutant(
        "straggler-reports-on-unshared-steps",
        "ddpnb/rank/radar.py",
        (("        if step % self.every and step - self.step < 4 * self.every:\n", "        if False:\n"),),
        # ranks in DDP's lockstep mostly cross a time threshold at the same step too: the clock's own test pins it
        ("tests/test_radar.py::test_step_clock_reports_on_steps_every_rank_shares_and_restarts_on_a_new_count",),
    ),
    Mutant(
        "straggler-lateness-counts-itself",
        "ddpnb/core/stragglers.py",
        (("(ns - _median_without(values, index))", "(ns - _median_without(sorted(values + [ns]), index))"),),
        ("tests/test_radar.py::test_lateness_is_against_the_median_of_the_others_at_the_worst_collective_of_the_step",),
    ),
    # --- a thousand ranks at a glance (issue 44) ---------------------------------------------------------------------
    Mutant(
        "dashboard-sets-a-widget-before-the-redraw-is-built",
        "ddpnb/views/dashboard.py",
        (
            (
                "            values: list[tuple[Any, str]] = [\n                (self.header, header_html(record)),\n",
                "            self.header.value = header_html(record)\n            values: list[tuple[Any, str]] = [\n",
            ),
        ),
        ("tests/test_scale.py::test_a_redraw_builds_every_part_before_it_sets_any_widget",),
    ),
    # --- a bug of ddpnb's own in the reader ----------------------------------------------------------------------------
    Mutant(
        "a-views-data-bug-ends-the-run",
        "ddpnb/core/attempt.py",
        (("            if what in self._said:\n                return\n", "            raise\n"),),
        (FAULTS + "test_a_message_that_only_feeds_views_and_breaks_the_kernel_is_said_once_and_the_run_goes_on",),
    ),
    Mutant(
        "a-reader-bug-left-to-the-threads-excepthook",
        "ddpnb/core/lifecycle.py",
        (
            (
                (
                    "            self.attempt.engine.serve()\n        except Exception as exc:  # noqa: BLE001 - said in the "
                    "run's outcome, not only on the kernel's stderr\n            self.attempt.failed_inside(exc)\n"
                ),
                "            self.attempt.engine.serve()\n        except Exception:\n            raise\n",
            ),
        ),
        (FAULTS + "test_a_bug_in_the_kernels_reading_of_the_ranks_fails_the_run_saying_so_and_stops_every_rank",),
    ),
    Mutant(
        "orphans-of-a-rank-left-running",
        "ddpnb/node/forked.py",
        (
            (
                "        orphans.end_orphans(_compat.forkserver_pid(), _running | forkserver.spared())\n",
                "        pass\n",
            ),
        ),
        (
            FAULTS + CHILD_PATHS + "[succeeds]",
            FAULTS + CHILD_PATHS + "[raises]",
            FAULTS + CHILD_PATHS + "[stopped]",
            FAULTS + "test_process_that_escapes_the_ranks_group_cannot_hang_the_run_and_ends_with_it",
            SLURM + "test_what_a_rank_started_in_a_session_of_its_own_is_gone_after_the_run_on_both_nodes[stopped]",
        ),
    ),
    Mutant(
        "forkserver-not-a-subreaper",
        "ddpnb/node/shield.py",
        (("\nbecome_subreaper()\n", "\n"),),
        (FAULTS + CHILD_PATHS + "[succeeds]", FAULTS + CHILD_PATHS + "[raises]"),
    ),
    Mutant(
        "rank-not-a-subreaper",
        "ddpnb/node/rank.py",
        (("    orphans.become_subreaper()  #", "    pass  #"),),
        (CHILDREN + "test_a_ranks_daemon_runs_on_while_the_rank_does_even_after_another_rank_ended",),
    ),
    Mutant(
        "notebook-definitions-not-in-the-ranks-main",
        "ddpnb/rank/main.py",
        (("        notebook.adopt(fn)  #", "        pass  #"),),
        (CHILDREN + "test_a_notebook_dataset_and_function_reach_dataloader_workers_and_a_pool_in_a_ddp_cell",),
    ),
    Mutant(
        "start-method-inherited-from-the-forkserver",
        "ddpnb/rank/notebook.py",
        (("    multiprocessing.set_start_method(None, force=True)", "    pass  #"),),
        (CHILDREN + "test_every_start_method_a_rank_can_pick_finds_the_notebooks_definitions",),
    ),
    Mutant(
        "spawned-children-main-not-rebuilt",
        "ddpnb/rank/notebook.py",
        (("    _compat.wrap_preparation_data(_with_notebook_main)\n", ""),),
        (
            CHILDREN + "test_every_start_method_a_rank_can_pick_finds_the_notebooks_definitions",
            CHILDREN + "test_a_class_defined_in_a_session_cell_reaches_a_spawned_dataloader_worker",
        ),
    ),
    Mutant(
        "a-group-of-the-codes-own-silently-ignored",
        "ddpnb/rank/group.py",
        (
            (
                '    runs = (rank, world_size) == (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))\n',
                "    runs = True\n",
            ),
        ),
        (
            CHILDREN + "test_trainers_that_make_a_group_of_their_own_train_as_under_mp_spawn[ddpnb]",
            CHILDREN + "test_a_checkpoint_in_a_group_of_the_codes_own_is_refused_saying_why",
        ),
    ),
    Mutant(
        "collective-hint-under-every-timeout",
        "ddpnb/core/hints.py",
        (("    if waiting and len(waiting) < len(ranks):\n", "    if True:\n"),),
        (
            NEWCOMER + "test_a_timeout_without_a_collective_gives_no_collective_hint",
            NEWCOMER
            + "test_the_collective_hint_comes_where_a_rank_waited_in_one_while_another_was_elsewhere_or_had_ended",
        ),
    ),
    Mutant(
        "failed-cell-repeats-the-summary-in-its-error",
        "ddpnb/views/dashboard.py",
        (("                        run.summary_above = True\n", "                        pass\n"),),
        (NEWCOMER + "test_a_failed_cell_shows_the_rank_table_and_the_logs_once",),
    ),
    Mutant(
        "last-run-is-the-session",
        "ddpnb/_api.py",
        (("    if not commands:  # a session is not a run", "    if True:  # a session is not a run"),),
        (NEWCOMER + "test_last_run_after_a_session_is_the_latest_ddp_run_and_the_session_is_named_as_one",),
    ),
    # --- bad input refused before anything starts (issue 40) ----------------------------------------------------------
    Mutant(
        "a-bool-passes-as-nprocs",
        "ddpnb/core/spec.py",
        (
            (
                "    if nprocs is not None and (isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1):",
                "    if nprocs is not None and (not isinstance(nprocs, int) or nprocs < 1):",
            ),
        ),
        (BAD_INPUT + "[nprocs-a-bool]", BAD_INPUT + "[a-session's-nprocs-a-bool]"),
    ),
    Mutant(
        "env-names-unchecked",
        "ddpnb/core/spec.py",
        (('ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")', 'ENV_NAME = re.compile(r"(?s).*")'),),
        (BAD_INPUT + "[env-name-with-=]", BAD_INPUT + "[--env-name-with-a-space]"),
    ),
    Mutant(
        "local-ranks-unbounded-by-cpus",
        "ddpnb/core/spec.py",
        (("    if ranks > bound and not oversubscribe:", "    if False:"),),
        (BAD_INPUT + "[more-than-8-ranks-a-CPU]",),
    ),
    Mutant(
        "hints-offer-every-engines-flags",
        "ddpnb/_magic.py",
        (
            (
                "    offered = [option for option in known if option not in _other_engines_flags(_engine_in(parser, line))]",
                "    offered = known",
            ),
        ),
        ("tests/test_bad_input.py::test_unknown_flag_hints_name_only_flags_of_the_engine_in_use",),
    ),
    Mutant(
        "exported-script-ends-through-python-teardown",
        "ddpnb/script/writer.py",
        (('        "    os._exit(0)",\n', ""),),
        ("tests/test_export.py::test_exported_script_ends_when_the_function_returns_whatever_threads_it_left",),
    ),
    Mutant(
        "exported-script-skips-the-functions-atexit-handlers",
        "ddpnb/script/writer.py",
        (('        "    atexit._run_exitfuncs()",\n', ""),),
        ("tests/test_export.py::test_exported_script_ends_when_the_function_returns_whatever_threads_it_left",),
    ),
    Mutant(
        "export-takes-ipythons-open-for-the-notebooks",
        "ddpnb/script/sources.py",
        ((" or _shells(looked_up, scope):", ":"),),
        ("tests/test_export.py::test_varied_function_exported_runs_to_the_cells_result[opens_file]",),
    ),
]
ROOT = Path(__file__).resolve().parent.parent
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h: what a mutant's tests leave behind is reparented to this script


def _end_leftovers() -> None:
    """End what a mutant's tests left running (a broken Slurm keeper leaves its `salloc`): this script's own
    orphans only, never another user's or another checkout's processes."""
    while True:
        pids = [
            int(pid) for task in Path("/proc/self/task").iterdir() for pid in (task / "children").read_text().split()
        ]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in pids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def _dirty(path: str) -> bool:
    status = subprocess.run(
        ["git", "status", "--porcelain", "--", path], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return bool(status.stdout.strip())


def _mutated(mutant: Mutant, original: str) -> str:
    text = original
    for old, new in mutant.edits:
        count = text.count(old)
        if count != 1:
            raise SystemExit(f"{mutant.name}: its snippet occurs {count} times in {mutant.path} (re-target it):\n{old}")
        text = text.replace(old, new)
    return text


def _run_tests(mutant: Mutant) -> tuple[bool, dict[str, str], str]:
    """(killed, the tests that failed with the reason pytest's summary gives, pytest's last line)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "COLUMNS": "1000",
    }  # wide enough for pytest's summary to keep each failure's message after its node id
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rf", "-p", "no:cacheprovider", "-p", "no:randomly", *mutant.tests],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    _end_leftovers()
    failed = dict(re.findall(r"^FAILED (\S+?)(?: - (.*))?$", done.stdout, re.MULTILINE))
    last = (done.stdout.strip().splitlines() or [""])[-1]
    if done.returncode not in (0, 1):  # interrupted, a usage error, no tests collected: not a kill
        return False, {}, f"pytest exited with {done.returncode}: {last}"
    return done.returncode == 1, failed, last


def check(mutant: Mutant, repeat: int) -> tuple[int, dict[str, str], str]:
    """Apply `mutant`, run its tests `repeat` times, restore the file; how many runs killed it, and by which tests
    (each with why it failed: a kill is only worth its name for the reason the mutant names)."""
    path = ROOT / mutant.path
    if _dirty(mutant.path):
        raise SystemExit(f"{mutant.path} has uncommitted changes: commit or stash them before a mutation check")
    original = path.read_text()
    mutated = _mutated(mutant, original)
    kills, killers, last = 0, {}, ""
    try:
        path.write_text(mutated)
        for _ in range(repeat):
            killed, failed, last = _run_tests(mutant)
            kills += killed
            killers.update({test.removeprefix("tests/"): why for test, why in failed.items()})
    finally:
        path.write_text(original)
    return kills, killers, last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutants to check (default: all)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each mutant's tests (default 1)")
    parser.add_argument("--list", action="store_true", help="list the mutants and their tests, and exit")
    parser.add_argument("--why", action="store_true", help="under each mutant, why each killing test failed")
    options = parser.parse_args()
    chosen = [m for m in MUTANTS if not options.names or m.name in options.names]
    unknown = set(options.names) - {m.name for m in MUTANTS}
    if unknown:
        raise SystemExit(f"no such mutant: {', '.join(sorted(unknown))} (see --list)")
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    if options.list:
        for mutant in chosen:
            print(f"{mutant.name}  ({mutant.path})\n  " + "\n  ".join(mutant.tests))
        return
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a SIGTERM restores the file too
    survivors = []
    print(f"{'mutant':<48} {'result':<16} killed by")
    for mutant in chosen:
        kills, killers, last = check(mutant, options.repeat)
        result = (
            f"killed {kills}/{options.repeat}"
            if kills == options.repeat
            else f"SURVIVED {options.repeat - kills}/{options.repeat}"
        )
        if kills < options.repeat:
            survivors.append(mutant.name)
        print(f"{mutant.name:<48} {result:<16} {', '.join(sorted(killers)) or last}", flush=True)
        if options.why:
            for test, why in sorted(killers.items()):
                print(f"    {test.partition('::')[2]}: {why[:160]}", flush=True)
    print(f"\nsurvivors: {', '.join(survivors) or 'none'}")
    sys.exit(1 if survivors else 0)


if __name__ == "__main__":
    main()
