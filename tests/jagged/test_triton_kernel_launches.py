"""Every launch of the benchmark's tuning space (`CANDIDATE_LAUNCHES`), with its own orientation set, byte for
byte against the reference: in the interpreter on CPU (where the thread layout is moot but the strip axes,
the chunk size and the reductions over them are what run), with the hardware cast on a GPU."""
import pytest
import torch

from gem_lp.jagged import JaggedLayout
from gem_lp.jagged.tensor import scale_sizes
from gem_lp.jagged.kernels.triton_quantize import DEFAULT_LAUNCH, LAUNCH_SETS, LaunchOptions
from benchmarks.launch_candidates import CANDIDATE_LAUNCHES, PERSISTENT_LAUNCHES
from gem_lp.mx.formats import PAYLOAD_DTYPE
from jagged_launch_check import check_launch

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

# a short mix: a lone token, a partial 32-token block, a sequence crossing a 128-row tile, an empty one;
# the fixture's NaN/Inf/huge/subnormal values wrap onto these sequences
LENGTHS = (1, 33, 0, 129, 70)


def _cases():
    """The interpreter's cases, each (set name, rows, thread_rows, row_blocks_in_thread, tile_table,
    unmasked_full, const_strides, shift_offsets): each distinct strip shape of a set with the default code
    paths, then per set the strip shape whose candidate turns on the most byte-neutral options, with all of
    them (warps, register limits and direct_inverse, which needs the hardware cast, do not change what the
    interpreter computes; `test_lean_options_with_feature_chunks_and_strided_values` covers D = 96)."""
    seen = {}
    for set_name, launches in CANDIDATE_LAUNCHES.items():
        options = [LaunchOptions(*c) for c in launches]
        for o in options:
            seen.setdefault((set_name, o.rows, o.thread_rows, o.row_blocks_in_thread, False, False, False, False))
        lean = max(options, key=lambda o: o.tile_table + o.unmasked_full + o.const_strides + o.shift_offsets)
        seen.setdefault((set_name, lean.rows, lean.thread_rows, lean.row_blocks_in_thread, True, True, True, True))
    return list(seen)


def _full_cases():
    return sorted({(s, *LaunchOptions(*c)) for s, launches in CANDIDATE_LAUNCHES.items() for c in launches})


CASES = _cases() if not torch.cuda.is_available() else _full_cases()


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_candidate_launch_every_byte(mixed_batch, case):
    set_name, *fields = case
    if len(fields) == 7:  # the interpreter's cases
        options = dict(zip(("rows", "thread_rows", "row_blocks_in_thread", "tile_table", "unmasked_full",
                            "const_strides", "shift_offsets"), fields))
    else:
        options = LaunchOptions(*fields)._asdict()
    values, offsets = mixed_batch(1, 128, torch.bfloat16, lengths=LENGTHS)
    check_launch(values, offsets, LAUNCH_SETS[set_name], **options)


def test_max_registers_option(mixed_batch):
    """The register limit reaches the launch as Triton's `maxnreg` (none when 0) and is checked."""
    from gem_lp.jagged.kernels.triton_quantize import launch_args

    values, offsets = mixed_batch(1, 64, lengths=(3,))
    layout = JaggedLayout.from_offsets(offsets, values)
    payloads = {"hdim": torch.empty(values.shape, dtype=PAYLOAD_DTYPE)}
    scales = {"hdim": torch.empty(1, scale_sizes(layout.padded_total, 64)[0], dtype=torch.uint8)}

    def kwargs(**options):
        return launch_args(values, layout.offsets, layout.scale_offsets, layout.tile_seq, layout.padded_total,
                           payloads, scales, True, **options)[2]

    assert kwargs(max_registers=96)["maxnreg"] == 96
    assert "maxnreg" not in kwargs(max_registers=0) and "maxnreg" not in kwargs()
    for bad in (8, 256, -1):
        with pytest.raises(ValueError, match=f"max_registers must be 0 \\(no limit\\) or 16..255, got {bad}"):
            kwargs(max_registers=bad)


_HOPPER_CANDIDATES = """
import json, torch
from gem_lp.jagged.tensor import scale_sizes
from gem_lp.jagged.kernels.triton_quantize import LAUNCH_SETS, LaunchOptions, _jagged_mx_kernel, launch_args
from benchmarks.launch_candidates import CANDIDATE_LAUNCHES, PERSISTENT_LAUNCHES
from gem_lp.mx.formats import PAYLOAD_DTYPE
from gem_lp.mx.kernels.triton_quantize import compile_for_target, ptxas_usage
heads, dim, t, tp = 4, 128, 1000, 1280
values = torch.empty(t, heads, dim, dtype=torch.bfloat16)
offsets, scale_offsets = torch.tensor([0, 600, 1000]), torch.tensor([0, 640, 1280])
tile_seq = torch.zeros(tp // 128, dtype=torch.int32)
tile_tokens = torch.zeros(tp // 128, 2, dtype=torch.int64)
hb, sb = scale_sizes(tp, dim)
for set_name in LAUNCH_SETS:
    launches = (*CANDIDATE_LAUNCHES[set_name], *PERSISTENT_LAUNCHES.get(set_name, ()))
    orients = LAUNCH_SETS[set_name]
    payloads = {o: torch.empty(t, heads, dim, dtype=PAYLOAD_DTYPE) for o in orients}
    scales = {s: torch.empty(heads, hb if s.endswith("hdim") else sb, dtype=torch.uint8)
              for o in orients for s in ((o,) if o != "square" else ("square_hdim", "square_seq"))}
    for c in launches:
        opts = LaunchOptions(*c)
        grid, args, kwargs = launch_args(values, offsets, scale_offsets, tile_seq, tp, payloads, scales, True,
                                         tile_tokens=tile_tokens, hw_cast=True, **opts._asdict())
        regs, spills = ptxas_usage(compile_for_target(_jagged_mx_kernel, args, kwargs).asm["ptx"])
        print(json.dumps(dict(set=set_name, launch=list(opts), regs=regs, spills=spills)))
"""


def test_candidate_launches_build_for_hopper_without_spills():
    """Every candidate launch, persistent walks included, builds for sm_90 (hardware cast, H4 D128) within its
    register limit and without spills."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0")  # a compiled, not interpreted, kernel object
    done = subprocess.run([sys.executable, "-c", _HOPPER_CANDIDATES], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    builds = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    n_launches = sum(len(group) for group in (*CANDIDATE_LAUNCHES.values(), *PERSISTENT_LAUNCHES.values()))
    assert len(builds) == n_launches, done.stdout
    for b in builds:
        limit = b["launch"][4]  # LaunchOptions.max_registers
        assert b["spills"] == 0 and (limit == 0 or b["regs"] <= limit), b
    # the hdim+seq default fits 8 programs of 64 threads per SM (no more than 128 registers)
    default = [b for b in builds if b["set"] == "hdim+seq" and tuple(b["launch"]) == DEFAULT_LAUNCH["seq"]]
    assert len(default) == 1 and default[0]["regs"] <= 128, default


def test_lean_options_with_feature_chunks_and_strided_values(mixed_batch):
    """tile_table, unmasked_full, const_strides and shift_offsets (and direct_inverse, a no-op without the
    hardware cast) with D = 96: three 32-feature chunks, padding columns of the hdim form and padding rows of
    the seq form; on contiguous values (compile-time strides) and on a view with a head stride of 3 * 96
    (runtime strides)."""
    options = dict(rows=32, thread_rows=4, direct_inverse=True, tile_table=True, unmasked_full=True,
                   const_strides=True, shift_offsets=True)
    values, offsets = mixed_batch(2, 96, torch.bfloat16, lengths=(1, 33, 0, 64, 129))
    check_launch(values, offsets, ("hdim", "seq", "square"), **options)
    wide = torch.zeros(values.shape[0], 3, 96, dtype=values.dtype, device=values.device)
    wide[:, 1:] = values
    check_launch(wide[:, 1:], offsets, ("hdim", "seq", "square"), **options)
