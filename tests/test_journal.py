"""The journal (issue 42): its file, torn and corrupt journals, versions, and replay into the owner's own record."""

from __future__ import annotations

import json
import os
import stat
import threading
import zlib
from pathlib import Path

import pytest

from ddpnb.core.journal import entries
from ddpnb.core.journal.frames import FRAME, MAGIC, Follower, JournalError, Reader, Writer


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
