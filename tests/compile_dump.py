"""The PTX of the CuTe kernels as `gem_lp.compile_check` builds them, for tests that check what a build holds.

`make test` runs `python -m gem_lp.compile_check --arch <arch> --dump-dir $DIR/<arch>` for sm_90a and sm_100a first
and exports `GEM_LP_COMPILE_DUMP=$DIR`: the tests read those files instead of building the kernels again. When the
variable is unset, the op's kernels are built here, once per (arch, op) and process, by the same command in a child
process (the CuTe DSL reads its target from the environment at import). When it is set, the dump must hold the arch:
a missing one is an error, not a silent rebuild.

A dump holds one directory per build (`compile_check.build_label`: op, direction, precision, mode) with that build's
PTX files (`cutlass___call___<module><Class>_object_at__<arguments>.<arch>.ptx`: the class, then the arguments'
dtypes and static shapes). Tests name builds by patterns of `<build label>/<file name>`.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import pytest

ENV = "GEM_LP_COMPILE_DUMP"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BUILT: dict[tuple[str, str], str] = {}  # (arch, op) -> the dump dir of this process's build


def stack_missing() -> str | None:
    """Why the CuTe DSL stack cannot build here (None when it can); with a dump, nothing needs building."""
    if os.environ.get(ENV):
        return None
    from gem_lp.runtime.device import cute_stack_missing

    return cute_stack_missing()


def dump_dir(arch: str, op: str) -> str:
    """The directory holding the PTX of `arch`'s builds of `op` (compile_check's `--op`: cast, norm, linear, ...)."""
    root = os.environ.get(ENV)
    if root:
        path = os.path.join(root, arch)
        if not os.path.isdir(path):
            pytest.fail(f"{ENV}={root} holds no {arch} dump ({path}): run `python -m gem_lp.compile_check --arch "
                        f"{arch} --dump-dir {path}` first, or unset {ENV} to build here")
        return path
    key = (arch, op)
    if key not in _BUILT:
        path = tempfile.mkdtemp(prefix=f"compile_dump_{arch}_{op}_")
        done = subprocess.run([sys.executable, "-m", "gem_lp.compile_check", "--arch", arch, "--op", op, "--dump-dir",
                               path], cwd=ROOT, capture_output=True, text=True, timeout=900,
                              env={**os.environ, "TRITON_INTERPRET": "0"})
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        _BUILT[key] = path
    return _BUILT[key]


def ptx_texts(pattern: str, arch: str, op: str) -> dict[str, str]:
    """{file name: PTX text} of `arch`'s builds of `op` whose dump file name matches the regular expression `pattern`
    (searched); an error when none does (the build is missing from compile_check's targets)."""
    from gem_lp.compile_check import RAW_DIR

    path = dump_dir(arch, op)
    names = sorted(f"{build}/{f}" for build in os.listdir(path) if build != RAW_DIR
                   and os.path.isdir(os.path.join(path, build))
                   for f in os.listdir(os.path.join(path, build)) if f.endswith(".ptx"))
    names = [n for n in names if re.search(pattern, n)]
    if not names:
        pytest.fail(f"no {arch} PTX in {path} matches {pattern!r}")
    out = {}
    for name in names:
        with open(os.path.join(path, name)) as f:
            out[name] = f.read()
    return out
