"""First-use self-checks of the GPU kernels.

An implementation of the dispatch table that has not been verified on this device (GPU name, driver, the versions of
torch, Triton, the CuTe DSL stack, and gem_lp's own sources) is checked the first time a plan would take it: its check
(`Impl.check`, a function of the op package's `selfchecks` module) runs in a child process with a time limit, so that
a hang or a sticky CUDA fault cannot take the caller down, on fixed small problems (odd lengths, an outlier case)
against the reference, within the error budget of docs/numerics.md, and twice (the results must repeat bit for
bit). The verdict is cached on disk, one JSON file per device fingerprint under `$GEM_LP_CACHE_DIR/selfcheck`
(default `~/.cache/gem_lp/selfcheck`; delete it to check again). A failed or timed-out check warns with its numbers
and the plan moves the op to its next implementation. `GEM_LP_SELFCHECK=off` skips the checks (the plan then says
"unchecked").

`python -m gem_lp.selfcheck` runs every check of the current plan in-process and times each kernel beside its peer.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.metadata
import json
import logging
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import warnings

import torch

log = logging.getLogger("gem_lp")

ENABLE_ENV = "GEM_LP_SELFCHECK"
CACHE_ENV = "GEM_LP_CACHE_DIR"
TIMEOUT_ENV = "GEM_LP_SELFCHECK_TIMEOUT"
DEFAULT_TIMEOUT_S = 600
PACKAGES = ("torch", "triton", "nvidia-cutlass-dsl", "flash-attn-4", "quack-kernels")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The outcome of one implementation's self-check on one device: `passed`, a one-line `summary` (the figures),
    the check's `details`, and whether it ran at all (`checked` False: skipped, counted as passed)."""

    passed: bool
    summary: str
    details: dict = dataclasses.field(default_factory=dict)
    checked: bool = True

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def enabled() -> bool:
    return os.environ.get(ENABLE_ENV, "on").strip().lower() not in ("off", "0", "false", "no")


@functools.lru_cache(maxsize=None)
def _source_hash() -> str:
    """A hash of gem_lp's Python sources: a kernel that changed must be verified again."""
    root = pathlib.Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _driver_version() -> str:
    try:
        text = pathlib.Path("/proc/driver/nvidia/version").read_text()
        for word in text.split():
            if word.count(".") >= 1 and word.replace(".", "").isdigit():
                return word
    except OSError:
        pass
    try:
        from cuda.bindings import driver

        err, version = driver.cuDriverGetVersion()
        return str(version)
    except Exception:  # no cuda-bindings, or no driver: the fingerprint says so
        return "unknown"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


@functools.lru_cache(maxsize=None)
def fingerprint(index: int) -> dict:
    """What a verdict holds for: the GPU, its driver, the packages and gem_lp's sources."""
    props = torch.cuda.get_device_properties(index)
    return {"gpu": props.name, "capability": f"{props.major}.{props.minor}", "driver": _driver_version(),
            "cuda": torch.version.cuda, **{p: _version(p) for p in PACKAGES}, "gem_lp": _source_hash()}


def cache_dir() -> pathlib.Path:
    root = os.environ.get(CACHE_ENV)
    return pathlib.Path(root) if root else pathlib.Path.home() / ".cache" / "gem_lp" / "selfcheck"


def _cache_file(index: int) -> pathlib.Path:
    key = hashlib.sha256(json.dumps(fingerprint(index), sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / f"{key}.json"


def _load(path: pathlib.Path) -> dict:
    try:
        return json.loads(path.read_text()).get("verdicts", {})
    except (OSError, ValueError):
        return {}


def _store(index: int, key: str, verdict: Verdict) -> None:
    path = _cache_file(index)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        verdicts = _load(path)
        verdicts[key] = verdict.as_dict()
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"fingerprint": fingerprint(index), "verdicts": verdicts}, f, indent=1)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only home: the verdict holds for this process only
        log.warning("gem_lp: could not cache the self-check verdict of %s in %s (%s)", key, path, exc)


def _device_index(device: torch.device) -> int:
    return torch.cuda.current_device() if device.index is None else device.index


_RUN: dict[tuple[int, str], Verdict] = {}


def verdict(op: str, precision: str, name: str, impl, device: torch.device) -> Verdict | None:
    """The verdict of implementation `name` of (op, precision) on `device`, from this process, the disk cache, or a
    check run now in a child process; None off a GPU."""
    if device.type != "cuda" or impl.check is None:
        return None
    from gem_lp.runtime.dispatch import arch_of, impl_key

    key = impl_key(op, precision, name, arch_of(device))
    index = _device_index(device)
    known = _RUN.get((index, key))
    if known is not None:
        return known
    if not enabled():
        result = Verdict(True, f"unchecked ({ENABLE_ENV}=off)", checked=False)
    else:
        cached = _load(_cache_file(index)).get(key)
        if cached is not None:
            result = Verdict(**cached)
        else:
            result = _run_child(key, index)
            _store(index, key, result)
            level = logging.INFO if result.passed else logging.WARNING
            log.log(level, "gem_lp self-check %s on %s: %s (%s)", key, fingerprint(index)["gpu"],
                    "passed" if result.passed else "FAILED", result.summary)
            if not result.passed:
                warnings.warn(f"gem_lp: the self-check of {key} failed on {fingerprint(index)['gpu']}: "
                              f"{result.summary}; the op takes its next implementation", stacklevel=3)
    _RUN[(index, key)] = result
    return result


def _run_child(key: str, index: int) -> Verdict:
    timeout = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
    cmd = [sys.executable, "-m", "gem_lp.selfcheck", "--run", key, "--device", f"cuda:{index}", "--json"]
    env = dict(os.environ, **{ENABLE_ENV: "off"})  # the child runs the check itself, no nested checks
    t0 = time.time()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return Verdict(False, f"timed out after {timeout:.0f} s")
    seconds = time.time() - t0
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            try:
                out = json.loads(line)
            except ValueError:
                break
            out.setdefault("details", {})["seconds"] = round(seconds, 1)
            return Verdict(bool(out["passed"]), out["summary"], out["details"])
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return Verdict(False, f"the check process exited with {done.returncode}: {' | '.join(tail)[:400]}")


def run_check(key: str, device: torch.device, timed: bool = False) -> dict:
    """Run the check of implementation `key` (`op/precision/impl/arch`) in this process: `{"passed", "summary",
    "details"}` (with `timed`, the details hold the kernel's time beside its peer's)."""
    from gem_lp.runtime.dispatch import IMPLS

    op, precision, name, _ = key.split("/")
    impl = IMPLS[(op, precision)][name]
    module, _, attr = impl.check.partition(":")
    fn = getattr(importlib.import_module(module), attr)
    try:
        details = fn(device, timed=timed)
    except Exception as exc:  # a crash is a failed check, with what it said
        return {"passed": False, "summary": f"raised {type(exc).__name__}: {str(exc)[:300]}", "details": {}}
    return {"passed": bool(details.pop("passed")), "summary": details.pop("summary"), "details": details}


def record(device: torch.device, key: str, out: dict) -> None:
    """Cache the outcome of a check run in this process (`run_check`) as the device's verdict for `key`."""
    index = _device_index(device)
    result = Verdict(bool(out["passed"]), out["summary"], {k: v for k, v in out["details"].items() if k != "speed"})
    _store(index, key, result)
    _RUN[(index, key)] = result


def clear() -> None:
    """Forget the verdicts of this process (the disk cache stays)."""
    _RUN.clear()
