"""Checkpoint files: checksum verified on load (errors name the file), temp files cleaned, the user's umask."""
import math
import os
import stat

import pytest
import torch

from gem_lp.train import CheckpointError, Trainer, load_checkpoint, save_atomic
from gem_lp.train.checkpoint import HEADER_BYTES, remove_stale_temp_files, write_json_atomic

STATE = {"step": 3, "weights": torch.arange(1000, dtype=torch.float32)}


@pytest.fixture
def checkpoint(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_atomic(STATE, path)
    return path


def test_round_trip(checkpoint):
    state = load_checkpoint(checkpoint)
    assert state["step"] == 3 and torch.equal(state["weights"], STATE["weights"])


@pytest.mark.parametrize("where", ["payload start", "payload middle", "payload end", "checksum"])
def test_changed_bytes_are_detected(checkpoint, where):
    data = bytearray(checkpoint.read_bytes())
    offset = {"payload start": HEADER_BYTES, "payload middle": (HEADER_BYTES + len(data)) // 2,
              "payload end": len(data) - 4, "checksum": 8}[where]
    for i in range(offset, offset + 4):  # four changed bytes
        data[i] ^= 0x5A
    checkpoint.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"checkpoint {checkpoint} is corrupt: the SHA-256"):
        load_checkpoint(checkpoint)


def test_truncated_and_foreign_files(checkpoint, tmp_path):
    data = checkpoint.read_bytes()
    checkpoint.write_bytes(data[:-100])
    size = len(data) - HEADER_BYTES
    with pytest.raises(CheckpointError, match=f"checkpoint {checkpoint} is truncated: it holds {size - 100} bytes of "
                                              f"state, its header announces {size}"):
        load_checkpoint(checkpoint)
    for content in (b"", data[:20], b"x" * 5000):
        checkpoint.write_bytes(content)
        with pytest.raises(CheckpointError, match=f"checkpoint {checkpoint} is not a gem-lp checkpoint file"):
            load_checkpoint(checkpoint)
    plain = tmp_path / "plain.pt"
    torch.save(STATE, plain)  # a bare torch.save file (as older gem-lp versions wrote)
    with pytest.raises(CheckpointError, match=f"checkpoint {plain} is not a gem-lp checkpoint file"):
        load_checkpoint(plain)
    with pytest.raises(CheckpointError, match="is a directory"):
        load_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "missing.pt")


def test_resume_from_a_corrupted_checkpoint_fails_naming_it(tiny_config, tmp_path):
    Trainer(tiny_config("trainer.max_steps=4", "trainer.stop_after=2"), tmp_path).fit()
    path = tmp_path / "checkpoint.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2:len(data) // 2 + 4] = b"\x00\x01\x02\x03"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"checkpoint {path} is corrupt"):
        Trainer(tiny_config("trainer.max_steps=4", "resume=true"), tmp_path)


def test_stale_temp_files_are_removed_when_a_run_starts(tiny_config, tmp_path, caplog):
    """What a process killed while writing (SIGKILL) leaves behind is removed, and said, at the next start."""
    stale = [tmp_path / ".checkpoint.pt.ab12cd34.tmp", tmp_path / ".checkpoint.pt.k_9x2z1q.tmp",
             tmp_path / ".metrics.json.0011aabb.tmp"]
    for path in stale:
        path.write_bytes(b"\0" * 1000)
    keep = tmp_path / "notes.tmp"
    keep.write_text("not ours")
    caplog.set_level("WARNING", logger="gem_lp.train")
    Trainer(tiny_config(), tmp_path)
    assert not any(p.exists() for p in stale) and keep.exists()
    assert all(str(p) in caplog.text for p in stale)


def test_failed_writes_leave_no_temp_file(tmp_path):
    with pytest.raises(Exception):
        save_atomic({"a": lambda: None}, tmp_path / "ckpt.pt")  # not picklable
    with pytest.raises(ValueError, match="Out of range float"):
        write_json_atomic({"eval_auc": math.nan}, tmp_path / "metrics.json")  # NaN is not JSON
    assert os.listdir(tmp_path) == []
    assert remove_stale_temp_files(tmp_path / "none" / "x.pt") == []


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_files_follow_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        save_atomic(STATE, tmp_path / "checkpoint.pt")
        write_json_atomic({"a": 1}, tmp_path / "metrics.json")
    finally:
        os.umask(old)
    for name in ("checkpoint.pt", "metrics.json"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~umask, name
