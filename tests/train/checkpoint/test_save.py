"""Checkpoint manifests (train/checkpoint/save.py): each rank hashes the files it wrote, rank 0 the rest."""

from __future__ import annotations

import hashlib
import json

from posfreq.train.checkpoint.layout import MANIFEST_FILE, TRAINER_FILE, rng_file, state_path
from posfreq.train.checkpoint.save import own_files, write_manifest


def test_a_rank_owns_its_shards_and_rng_file_only(tmp_path):
    """Rank 1's files are __1_*.distcp and rng/rank-1's, not rank 10's shard, the metadata or another rank's RNG."""
    state = state_path(tmp_path, True)
    state.mkdir()
    for name in ("__1_0.distcp", "__1_1.distcp", "__10_0.distcp", "__0_0.distcp", ".metadata"):
        (state / name).write_bytes(name.encode())
    for rank in (0, 1, 10):
        rng_file(tmp_path, rank).parent.mkdir(exist_ok=True)
        rng_file(tmp_path, rank).write_bytes(b"rng")
    assert own_files(tmp_path, 1) == [
        state / "__1_0.distcp",
        state / "__1_1.distcp",
        rng_file(tmp_path, 1),
    ]
    assert own_files(tmp_path, 10) == [state / "__10_0.distcp", rng_file(tmp_path, 10)]


def test_the_manifest_takes_known_entries_as_given_and_hashes_the_rest(tmp_path):
    """Entries hashed by the ranks that wrote them are recorded as they came (not read again); every other file is
    hashed here, against hashlib's digest of its bytes; the manifest and trainer.json are never listed."""
    (tmp_path / "sub").mkdir()
    files = {"a.json": b"{}", "sub/b.bin": b"\x00" * 5_000_000, TRAINER_FILE: b"{}"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    known = {"sub/b.bin": {"size": 5_000_000, "sha256": "from-its-rank"}}
    write_manifest(tmp_path, known)
    entries = json.loads((tmp_path / MANIFEST_FILE).read_text())["files"]
    assert entries == {
        "a.json": {"size": 2, "sha256": hashlib.sha256(b"{}").hexdigest()},
        "sub/b.bin": known["sub/b.bin"],
    }


def test_a_file_a_rank_reported_is_in_the_manifest_though_the_listing_lags(tmp_path):
    """On NFS rank 0's directory listing can lag node 2's writes by seconds: a shard whose hash node 2 gathered but
    rank 0 cannot list yet is in the manifest all the same (the manifest was rank 0's listing alone)."""
    (tmp_path / "a.json").write_bytes(b"{}")
    known = {
        "state/__9_0.distcp": {"size": 123, "sha256": "hashed-on-node-2"}
    }  # not (yet) listed here
    write_manifest(tmp_path, known)
    entries = json.loads((tmp_path / MANIFEST_FILE).read_text())["files"]
    assert entries["state/__9_0.distcp"] == known["state/__9_0.distcp"] and "a.json" in entries
