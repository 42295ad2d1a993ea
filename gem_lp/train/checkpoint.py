"""Atomic checkpoints (temp file + `os.replace`) and RNG state capture."""
from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch


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


def save_atomic(state: dict[str, Any], path: str | os.PathLike) -> None:
    """Write `state` with `torch.save` to a temp file in `path`'s directory, then `os.replace` it into place,
    so a reader (or a resumed run) never sees a partly written checkpoint."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"resume=true but no checkpoint at {path}; run without resume first, or point "
                                f"trainer.checkpoint_path (or hydra.run.dir) at the earlier run")
    # Our own files: they hold RNG states and Python numbers, so the full unpickler is needed.
    return torch.load(path, map_location="cpu", weights_only=False)


def write_json_atomic(obj: Any, path: str | os.PathLike) -> None:
    import json

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
