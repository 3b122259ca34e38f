"""batchgen.cache: atomic writes and remembered file digests."""

from __future__ import annotations

from batchgen.cache import file_digest, write_atomically


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
