"""batchgen.cache: atomic writes, their leftovers, and remembered file digests."""

from __future__ import annotations

import os
import time

from batchgen.cache import file_digest, remove_stale_temporaries, write_atomically


def test_atomic_writes_get_the_mode_open_would_give(tmp_path):
    """Run headers and digests are read by other users of a shared folder: not private 0o600 files."""
    write_atomically(tmp_path / "atomic", b"x")
    (tmp_path / "plain").write_bytes(b"x")
    assert (tmp_path / "atomic").stat().st_mode == (tmp_path / "plain").stat().st_mode


def test_file_digest_is_remembered_and_follows_edits(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(b"abc")
    memo = tmp_path / "memo"
    first = file_digest(f, memo)
    assert first == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"  # sha256("abc")
    assert len(list(memo.iterdir())) == 1 and file_digest(f, memo) == first
    f.write_bytes(b"abd")
    assert file_digest(f, memo) != first
    assert file_digest(f, memo, salt="1\0") != file_digest(f, memo)


def test_a_dead_writers_temporary_file_goes_a_live_ones_stays(tmp_path):
    """A process killed inside `write_atomically` leaves its `.tmp-*` file (a fresh-eyes session
    found 124 MB of a half-written quantized cache left so); the next writer removes such files
    once they are an hour old, never a younger one (another process may be writing it) nor a
    finished file."""
    dead, live, kept = tmp_path / ".tmp-dead", tmp_path / ".tmp-live", tmp_path / "weights.safetensors"
    for f in (dead, live, kept):
        f.write_bytes(b"x")
    hours_ago = time.time() - 7200
    os.utime(dead, (hours_ago, hours_ago))
    os.utime(kept, (hours_ago, hours_ago))
    remove_stale_temporaries(tmp_path)
    assert not dead.exists() and live.exists() and kept.exists()
