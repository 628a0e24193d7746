"""The journal (issue 42): its file, torn and corrupt journals, versions, and replay into the owner's own record."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import threading
import zlib
from collections import deque
from pathlib import Path

import pytest

import ddpnb
from ddpnb.core.journal import JOURNAL_FILE, JOURNAL_VAR, entries
from ddpnb.core.journal.frames import FRAME, MAGIC, Follower, JournalError, Reader, Writer
from ddpnb.core.journal.replay import Replay, replay
from ddpnb.core.spec import Stream
from ddpnb.detached import files
from tests.fake_engine import Exit, Gate, Print, Script, failed, finishes, metric, returned, started
from tests.test_faults import wait_for


def _write(path, payloads, header=None):
    writer = Writer(path, header or entries.header())
    for payload in payloads:
        writer.append(payload)
    writer.close()
    return writer


PAYLOADS = [f"record {i}".encode() * (i % 7 + 1) for i in range(200)]


@pytest.mark.fast
def test_a_journal_reads_back_every_record_in_order_from_a_private_file(tmp_path):
    path = tmp_path / "journal"
    _write(path, PAYLOADS)
    reader = Reader(path)
    assert reader.records() == PAYLOADS
    assert reader.torn is None
    assert reader.header["format"] == entries.FORMAT and reader.header["ddpnb"] == entries.version()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.fast
def test_a_journal_cut_mid_record_reads_what_is_whole_and_says_how_much_was_lost(tmp_path):
    path = tmp_path / "journal"
    _write(path, PAYLOADS)
    size = path.stat().st_size
    last = FRAME.size + len(PAYLOADS[-1])
    os.truncate(path, size - 3)  # the owner died inside its last write
    reader = Reader(path)
    assert reader.records() == PAYLOADS[:-1]
    assert reader.torn is not None and reader.torn.why == "cut short"
    assert reader.torn.lost == last - 3 and reader.torn.offset == size - last
    assert f"the last {last - 3} bytes could not be read" in str(reader.torn)


@pytest.mark.fast
def test_a_flipped_byte_stops_the_reader_at_that_record(tmp_path):
    path = tmp_path / "journal"
    _write(path, PAYLOADS)
    data = bytearray(path.read_bytes())
    whole = Reader(path)
    whole.records()
    # the 101st record's payload: past the magic, the header and 100 frames
    offset = len(MAGIC) + FRAME.size + len(json.dumps(entries.header()))
    offset += sum(FRAME.size + len(p) for p in PAYLOADS[:100])
    data[offset + FRAME.size + 2] ^= 0xFF
    path.write_bytes(bytes(data))
    reader = Reader(path)
    assert reader.records() == PAYLOADS[:100]
    assert reader.torn is not None and reader.torn.why == "corrupt"
    assert reader.torn.offset == offset and reader.torn.lost == len(data) - offset


@pytest.mark.fast
def test_a_journal_of_another_format_or_schema_is_refused_saying_which_ddpnb_wrote_it(tmp_path):
    path = tmp_path / "journal"
    _write(path, PAYLOADS[:3], header={"ddpnb": "9.9.9", "format": entries.FORMAT + 1, "schema": "0123"})
    reader = Reader(path)
    with pytest.raises(JournalError) as raised:
        entries.check(reader.header, path)
    said = str(raised.value)
    assert "written by ddpnb 9.9.9" in said and f"journal format {entries.FORMAT + 1}" in said
    assert f"this is ddpnb {entries.version()}" in said and "pip install ddpnb==9.9.9" in said
    entries.check(entries.header(), path)  # its own version passes


@pytest.mark.fast
def test_what_is_no_journal_is_refused_clearly(tmp_path):
    with pytest.raises(JournalError, match="does not exist: the run has no journal"):
        Reader(tmp_path / "missing")
    (tmp_path / "other").write_bytes(b"PK\x03\x04 a zip file")
    with pytest.raises(JournalError, match="is not a ddpnb journal"):
        Reader(tmp_path / "other")
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(JournalError, match="has no header yet"):
        Reader(tmp_path / "empty")


@pytest.mark.fast
def test_a_follower_takes_records_as_batches_land_and_waits_for_a_frame_not_whole_yet(tmp_path):
    path = tmp_path / "journal"
    follower = Follower(path)
    assert follower.poll() == []  # no file yet
    writer = Writer(path, entries.header())
    writer.append(PAYLOADS[0])
    writer.flush()
    assert follower.poll() == [PAYLOADS[0]]
    # half a frame on disk: the writer is inside its write; the follower waits for the rest
    framed = FRAME.pack(len(PAYLOADS[1]), zlib.crc32(PAYLOADS[1])) + PAYLOADS[1]
    with open(path, "ab") as file:
        file.write(framed[:5])
    assert follower.poll() == []
    with open(path, "ab") as file:
        file.write(framed[5:])
    assert follower.poll() == [PAYLOADS[1]]
    for payload in PAYLOADS[2:]:
        writer.append(payload)
    writer.close()
    assert follower.poll() == PAYLOADS[2:] and follower.torn is None
    assert follower.offset == path.stat().st_size
    follower.close()


@pytest.mark.fast
def test_a_follower_over_a_read_function_takes_a_served_journal_in_pieces_as_a_file(tmp_path):
    """A served run's journal arrives as bytes from an offset, one call a poll (`engines.ray.detach.ServedRun`):
    pieces that cut frames and the header anywhere give the same records as the file."""
    path = tmp_path / "journal"
    calls: list[int] = []

    def served(offset: int, most: int) -> bytes | None:
        calls.append(offset)
        return files.RunDir(tmp_path).read("journal", offset, most=min(most, 7))

    follower = Follower(tmp_path / "elsewhere" / "journal", served)
    assert follower.poll() == []  # not there yet
    _write(path, PAYLOADS)
    got: list[bytes] = []
    while follower.offset < path.stat().st_size:
        got.extend(follower.poll())
    assert got == PAYLOADS and follower.torn is None
    assert len(calls) == len(set(calls)) + 1  # one call a poll, each from where the last stopped (the first: None)


@pytest.mark.fast
def test_a_follower_calls_a_corrupt_record_corrupt_once_it_stays_so(tmp_path):
    path = tmp_path / "journal"
    _write(path, PAYLOADS[:10])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    follower = Follower(path)
    got = follower.poll()
    assert got == PAYLOADS[:9]
    for _ in range(Follower.RETRIES):
        assert follower.poll() == []
    assert follower.torn is not None and follower.torn.why == "corrupt"
    assert follower.torn.lost == FRAME.size + len(PAYLOADS[9])


@pytest.mark.fast
def test_a_full_disk_stops_the_journal_not_the_writer(tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    writer = Writer(Path("/dev/full"), entries.header())  # every write fails with ENOSPC, as on a full disk
    writer.append(b"x" * 100)
    writer.flush()
    assert writer.failed is not None and writer.failed.errno == 28
    writer.append(b"more")  # taken and dropped: the run goes on
    writer.close()


@pytest.mark.fast
def test_concurrent_appends_from_one_thread_and_reads_from_another_see_only_whole_records(tmp_path):
    path = tmp_path / "journal"
    writer = Writer(path, entries.header())
    follower = Follower(path)
    done = threading.Event()
    seen: list[bytes] = []

    def read() -> None:
        while not done.is_set():
            seen.extend(follower.poll())
        seen.extend(follower.poll())

    reader = threading.Thread(target=read)
    reader.start()
    expected = [i.to_bytes(4, "little") * (i % 50 + 1) for i in range(20_000)]
    for i, payload in enumerate(expected):
        writer.append(payload)
        if i % 97 == 0:
            writer.flush()
    writer.close()
    done.set()
    reader.join()
    assert seen == expected and follower.torn is None


# --- replay: a record equal to the owner's ----------------------------------------------------------------------------
def differences(owner, replayed, where="record") -> list[str]:
    """Every field, at any depth, where the replayed record differs from the owner's: `where` names it."""
    if dataclasses.is_dataclass(owner) and not isinstance(owner, type):
        if type(owner) is not type(replayed):
            return [f"{where}: {type(owner).__name__} != {type(replayed).__name__}"]
        return [
            d
            for f in dataclasses.fields(owner)
            for d in differences(getattr(owner, f.name), getattr(replayed, f.name), f"{where}.{f.name}")
        ]
    if isinstance(owner, dict) and isinstance(replayed, dict):
        if owner.keys() != replayed.keys():
            return [f"{where}: keys {sorted(owner)} != {sorted(replayed)}"]
        return [d for key in owner for d in differences(owner[key], replayed[key], f"{where}[{key!r}]")]
    if (
        isinstance(owner, (list, tuple, deque))
        and isinstance(replayed, (list, tuple, deque))
        and not hasattr(owner, "_fields")
    ):
        if len(owner) != len(replayed):
            return [f"{where}: {len(owner)} items != {len(replayed)}"]
        return [d for i, (a, b) in enumerate(zip(owner, replayed)) for d in differences(a, b, f"{where}[{i}]")]
    return [] if owner == replayed else [f"{where}: {owner!r} != {replayed!r}"]


def _journaled(monkeypatch):
    monkeypatch.setenv(JOURNAL_VAR, "1")


def _fake(script, nprocs=2, **options):
    return ddpnb.launch(nothing, engine="fake", nprocs=nprocs, script=script, **{"view": "none", **options})


def nothing(*args):
    """What the fake's ranks "run": the script says what they do."""


def _same_as_replayed(handle) -> Replay:
    replayed = Replay.read(handle.record.run_dir)
    assert replayed.torn is None and replayed.done
    assert differences(handle.record, replayed.record) == []
    owner_lines, _, count = handle.lines_since(0)
    lines, lost, replayed_count = replayed.lines_since(0)
    assert (lines, lost, replayed_count) == (owner_lines, 0, count)
    return replayed


@pytest.mark.fast
def test_a_fake_run_with_a_failure_and_a_restart_replays_into_the_owners_record(monkeypatch):
    _journaled(monkeypatch)
    steps = [
        step
        for s in range(50)
        for step in (
            metric(0, s, loss=1 / (s + 1), acc=s / 50),
            metric(1, s, loss=2.0),
            Print(0, f"step {s}"),
            Print(1, f"rank 1 at {s}\n", Stream.STDERR),
        )
    ]
    attempt_0 = Script(
        [started(0), started(1), *steps, Print(0, "half a line"), failed(1, "ValueError", "bad batch"), Exit(1, 1)]
    )
    attempt_1 = Script(
        [started(0), started(1), *steps[:40], returned(0, {"loss": 0.5}), returned(1), Exit(0, 0), Exit(1, 0)]
    )
    handle = _fake([attempt_0, attempt_1], max_restarts=1)
    assert handle.result() == {"loss": 0.5}
    replayed = _same_as_replayed(handle)
    record = replayed.record
    assert record.outcome is ddpnb.Outcome.SUCCEEDED and len(record.attempts) == 1
    assert record.attempts[0].first_failure.rank == 1
    assert record.attempts[0].ranks[0].state is ddpnb.RankState.STOPPED  # stopped by the owner, as the journal says
    assert [p.step for p in record.metrics("loss", rank=0)] == [*range(50), *range(10)]
    assert replayed.attempt.result.take() == {"loss": 0.5}


@pytest.mark.fast
def test_a_stop_and_a_stall_are_the_owners_in_the_replay_not_decided_again(monkeypatch):
    _journaled(monkeypatch)
    gate = threading.Event()
    story = Script(
        [started(0), started(1), metric(0, 1, loss=1.0), Print(1, "waiting"), Gate(gate)],
        stacks={
            0: 'File "<cell>", line 3, in train\n  dist.all_reduce(t)\n',
            1: 'File "<cell>", line 5, in train\n  time.sleep(100)\n',
        },
    )
    handle = _fake(story, stall=0.3)
    wait_for(lambda: handle.record.stalled, "the stall doctor to find the run stalled")
    handle.stop()
    record = handle.wait()
    assert record.outcome is ddpnb.Outcome.STOPPED and record.stall is not None
    replayed = _same_as_replayed(handle)
    assert replayed.record.stall.diagnosis.ranks == record.stall.diagnosis.ranks


@pytest.mark.fast
def test_a_timed_out_run_replays_with_the_owners_stacks(monkeypatch):
    _journaled(monkeypatch)
    gate = threading.Event()
    story = Script(
        [started(0), started(1), Print(0, "before"), Gate(gate)],
        stacks={0: 'File "<cell>", line 3, in train\n  dist.all_reduce(t)\n', 1: ""},
    )
    handle = _fake(story, timeout=0.3)
    record = handle.wait()
    assert record.outcome is ddpnb.Outcome.TIMED_OUT and record.at_timeout is not None
    replayed = _same_as_replayed(handle)
    assert replayed.record.ranks[0].stack == record.ranks[0].stack != ""


@pytest.mark.fast
def test_a_journal_replays_as_far_as_it_is_whole(monkeypatch):
    _journaled(monkeypatch)
    story = Script(
        [*finishes(0, "ok"), started(1), *[Print(1, f"line {i}") for i in range(100)], returned(1), Exit(1, 0)]
    )
    handle = _fake(story)
    handle.result()
    path = handle.record.run_dir / JOURNAL_FILE
    size = path.stat().st_size
    os.truncate(path, size - 10)  # the end record, torn
    replayed = Replay.read(handle.record.run_dir)
    assert replayed.torn is not None and replayed.torn.lost > 0 and not replayed.done
    assert replayed.record.outcome is ddpnb.Outcome.RUNNING
    assert replayed.record.ranks[1].lines == 100 and replayed.record.ranks[0].state is ddpnb.RankState.FINISHED


@pytest.mark.fast
def test_ordinary_runs_write_no_journal(monkeypatch):
    monkeypatch.delenv(JOURNAL_VAR, raising=False)
    handle = _fake(Script([*finishes(0), *finishes(1)]))
    handle.result()
    assert not (handle.record.run_dir / JOURNAL_FILE).exists()
    with pytest.raises(JournalError, match="the run has no journal"):
        replay(handle.record.run_dir)


@pytest.mark.fast
def test_a_journal_that_cannot_be_written_is_said_in_the_record_and_the_run_goes_on(monkeypatch):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    _journaled(monkeypatch)
    # the run directory joined with an absolute name is that name: every write fails with ENOSPC, as on a full disk
    monkeypatch.setattr("ddpnb.core.journal.tee.JOURNAL_FILE", "/dev/full")
    handle = _fake(Script([*finishes(0, "ok"), *finishes(1)]))
    assert handle.result() == "ok"
    note = handle.record.launch_note
    assert "the run's journal stops at 0 bytes: writing /dev/full failed (OSError" in note
    assert note.count("journal stops") == 1
