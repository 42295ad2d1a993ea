"""Checkpoint files: atomic writes, a checksum verified on load, stale temp files removed, RNG state capture.

A checkpoint file is a 48-byte header, then the `torch.save` bytes of the state:
`b"GEMLPCK1"` (format and version), the SHA-256 of those bytes (32 bytes), their length (8 bytes,
little-endian). A truncated or altered file fails to load with an error naming it, instead of loading
garbage or failing inside the unpickler.

Files are written to a temp file beside the target (`.<name>.<random>.tmp`, created with the user's umask),
synced, then renamed over the target, so a reader never sees a partial file; a failed write removes its temp
file, and `remove_stale_temp_files` removes those of a process that was killed mid-write.

A run on several processes (torchrun) writes its sharded state, the model and the fused optimizer's state of the
sharded tables, with `torch.distributed.checkpoint` (each rank writes the shards it owns) into a directory beside
the checkpoint file, `<checkpoint>.shards/step_<step>.<token>/`: written under a temp name, renamed once every
rank has finished, and listed with the SHA-256 of each of its files in the checkpoint file that rank 0 then
writes as above. Loading verifies those checksums before reading the shards; a new save leaves the previous
directory in place until the checkpoint file names the new one.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import random
import secrets
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

MAGIC = b"GEMLPCK1"
HEADER_BYTES = len(MAGIC) + 32 + 8


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be used; the message names the file and what is wrong with it."""


def rng_states() -> dict[str, Any]:
    """Python, NumPy, torch CPU and (when present) CUDA generator states."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # seeds CUDA generators too


def _temp_name(path: Path) -> Path:
    return path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp"


def write_atomic(path: str | os.PathLike, write: Callable[[Any], None]) -> None:
    """Call `write(binary file)` on a temp file beside `path`, sync it, and rename it over `path`.

    The temp file is created like any other file (mode 0o666 less the umask, not mkstemp's 0o600) and is
    removed if anything fails before the rename.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def remove_stale_temp_files(path: str | os.PathLike) -> list[Path]:
    """Remove the temp files `write_atomic` leaves beside `path` when its process is killed mid-write;
    returns the paths removed."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    removed = []
    for tmp in sorted(path.parent.glob(f".{path.name}.*.tmp")):
        if tmp.is_file():
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def save_atomic(state: dict[str, Any], path: str | os.PathLike) -> None:
    """Write `state` as a checkpoint file (header with checksum, then `torch.save` bytes), atomically."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getbuffer()
    header = MAGIC + hashlib.sha256(payload).digest() + len(payload).to_bytes(8, "little")

    def write(f):
        f.write(header)
        f.write(payload)

    write_atomic(path, write)


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The state saved by `save_atomic`, after checking the file's length and checksum.

    Raises FileNotFoundError when there is no file, `CheckpointError` (naming the file) when it is not a
    checkpoint, truncated, altered, or unreadable.
    """
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"checkpoint {path} is a directory, not a checkpoint file")
    if not path.is_file():
        raise FileNotFoundError(f"resume=true but no checkpoint at {path}; run without resume first, or point "
                                f"trainer.checkpoint_path (or hydra.run.dir) at the earlier run")
    data = path.read_bytes()
    if len(data) < HEADER_BYTES or not data.startswith(MAGIC):
        raise CheckpointError(f"checkpoint {path} is not a gem-lp checkpoint file: it does not start with the "
                              f"{MAGIC.decode()} header (written by another program, an older gem-lp, or damaged)")
    digest = data[len(MAGIC):len(MAGIC) + 32]
    length = int.from_bytes(data[len(MAGIC) + 32:HEADER_BYTES], "little")
    payload = memoryview(data)[HEADER_BYTES:]
    if len(payload) != length:
        what = "truncated" if len(payload) < length else "longer than its header says"
        raise CheckpointError(f"checkpoint {path} is {what}: it holds {len(payload)} bytes of state, its header "
                              f"announces {length}")
    if hashlib.sha256(payload).digest() != digest:
        raise CheckpointError(f"checkpoint {path} is corrupt: the SHA-256 of its contents does not match the one "
                              f"written with it")
    try:
        # Our own files (checksum verified): they hold RNG states and Python numbers, so the full unpickler.
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)
    except Exception as err:
        raise CheckpointError(f"checkpoint {path} could not be read: {type(err).__name__}: {err}") from err
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(state).__name__}, not a training state")
    return state


def write_json_atomic(obj: Any, path: str | os.PathLike) -> None:
    """`obj` as indented JSON, atomically; NaN and infinities are refused (they are not JSON)."""
    text = json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n"
    write_atomic(path, lambda f: f.write(text.encode()))


def shards_dir(checkpoint_path: str | os.PathLike) -> Path:
    """Where a multi-process run keeps its sharded state: `<checkpoint>.shards/` beside the checkpoint file."""
    path = Path(checkpoint_path)
    return path.parent / f"{path.name}.shards"


def _sha256_of_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_sharded(state: dict[str, Any], checkpoint_path: str | os.PathLike, step: int, group) -> dict[str, Any]:
    """Write `state` (ShardedTensors, each rank's own shards, and replicated tensors) with
    `torch.distributed.checkpoint` into a new directory in `shards_dir(checkpoint_path)`; every rank calls it.

    Returns, on every rank, the record the checkpoint file keeps: `{"dir": <name>, "sha256": {file: hex digest}}`.
    The directory is written under a temp name and renamed by rank 0 once every rank has written its files.
    """
    root = shards_dir(checkpoint_path)
    name = group.broadcast_object(f"step_{step:08d}.{secrets.token_hex(4)}" if group.is_main else None)
    tmp = root / f".{name}.tmp"
    try:
        dcp.save(state, checkpoint_id=tmp)  # returns on every rank once rank 0 has written the metadata
    except BaseException:
        if group.is_main:
            _remove_tree(tmp)
        raise
    record = None
    if group.is_main:
        record = {"dir": name, "sha256": {f.name: _sha256_of_file(f) for f in sorted(tmp.iterdir())}}
        _fsync_directory(tmp)
        os.replace(tmp, root / name)
        _fsync_directory(root)
    return group.broadcast_object(record)


def verify_shards(checkpoint_path: str | os.PathLike, record: dict[str, Any]) -> str | None:
    """None when the shard directory that `record` names holds exactly its files with their SHA-256; otherwise
    what is wrong, naming the directory and the file."""
    directory = shards_dir(checkpoint_path) / record["dir"]
    if not directory.is_dir():
        return f"checkpoint {checkpoint_path}: its sharded state {directory} is missing"
    present = sorted(f.name for f in directory.iterdir())
    if present != sorted(record["sha256"]):
        return (f"checkpoint {checkpoint_path}: {directory} holds {present}, the checkpoint lists "
                f"{sorted(record['sha256'])}")
    for name, digest in record["sha256"].items():
        if _sha256_of_file(directory / name) != digest:
            return (f"checkpoint {checkpoint_path}: {directory / name} is corrupt: its SHA-256 does not match the "
                    f"one written with it")
    return None


def load_sharded(state: dict[str, Any], checkpoint_path: str | os.PathLike, record: dict[str, Any]) -> None:
    """Read the sharded state that `record` names into `state` in place (each rank its own shards); every rank
    calls it, after `verify_shards`."""
    dcp.load(state, checkpoint_id=shards_dir(checkpoint_path) / record["dir"])


def remove_stale_shards(checkpoint_path: str | os.PathLike, keep: str | None) -> list[Path]:
    """Remove the shard directories beside `checkpoint_path` other than `keep` (the one its checkpoint file names):
    temp directories of an interrupted save, and directories that a later checkpoint superseded or that no
    checkpoint file came to name. Returns the paths removed."""
    root = shards_dir(checkpoint_path)
    if not root.is_dir():
        return []
    removed = []
    for entry in sorted(root.iterdir()):
        if entry.name != keep and entry.is_dir() and (entry.name.startswith("step_") or entry.name.endswith(".tmp")):
            _remove_tree(entry)
            removed.append(entry)
    return removed


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
