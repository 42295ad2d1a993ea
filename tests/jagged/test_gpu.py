"""GPU checks: the compiled kernel (hardware E4M3 cast) byte for byte against the reference, on the
benchmarks' jagged workload A and on the mixed batch with outliers and non-finite values."""
import importlib.util
import pathlib
import warnings

import pytest
import torch

from gem_lp.jagged import JaggedLayout, dequantize_jagged, quantize_jagged
from gem_lp.jagged.tensor import scale_sizes
from gem_lp.jagged.kernels.triton_quantize import LaunchOptions, launch
from benchmarks.launch_candidates import CANDIDATE_LAUNCHES
from gem_lp.mx.formats import PAYLOAD_DTYPE

pytestmark = pytest.mark.gpu
ALL = ("hdim", "seq", "square")
OUTPUTS = ("payload_hdim", "payload_seq", "payload_square", "scale_hdim", "scale_seq", "scale_square_hdim",
           "scale_square_seq")


def assert_same_bytes(ours, ref):
    for name in OUTPUTS:
        a, b = getattr(ours, name), getattr(ref, name)
        assert (a is None) == (b is None), name
        if a is not None:
            diff = (a.view(torch.uint8) != b.view(torch.uint8)).nonzero()
            assert diff.numel() == 0, f"{name}: {diff.shape[0]} bytes differ, first at {diff[:4].tolist()}"


def _benchmark_common():
    """benchmarks/common.py (the workloads' length generator), loaded by path: `benchmarks` is not installed."""
    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "common.py"
    spec = importlib.util.spec_from_file_location("bench_common", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("scaling", ["rceil", "floor"])
def test_design_workload_bit_identical(scaling):
    lengths = _benchmark_common().lognormal_lengths(32, 1024, seed=0, lo=32, hi=4096)
    assert int(lengths.sum()) == 32088 and int(lengths.max()) == 3274
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    values = torch.randn(32088, 16, 128, device="cuda", generator=g).to(torch.bfloat16)
    layout = JaggedLayout.from_offsets(offsets, values)
    ours = quantize_jagged(values, layout, ALL, scaling=scaling, backend="triton")
    ref = quantize_jagged(values, layout, ALL, scaling=scaling, backend="reference")
    assert_same_bytes(ours, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scaling", ["rceil", "floor"])
@pytest.mark.parametrize("heads,dim", [(4, 128), (1, 32), (2, 96), (3, 64)])
def test_mixed_batch_every_byte(mixed_batch, dtype, scaling, heads, dim):
    _check_every_byte(mixed_batch, dtype, scaling, heads, dim)


LAUNCHES = sorted({LaunchOptions(*launch) for group in CANDIDATE_LAUNCHES.values() for launch in group})


@pytest.mark.parametrize("opts", LAUNCHES,
                         ids=[f"rows{o.rows}-t{o.thread_rows}{'b' if o.row_blocks_in_thread else ''}-w{o.num_warps}"
                              + (f"-r{o.max_registers}" if o.max_registers else "")
                              + ("-inv" if o.direct_inverse else "") + ("-table" if o.tile_table else "")
                              + ("-full" if o.unmasked_full else "") + ("-cs" if o.const_strides else "")
                              + ("-shift" if o.shift_offsets else "") + ("-fmax" if o.float_max else "")
                              for o in LAUNCHES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_launch_options_every_byte(mixed_batch, opts, dtype):
    """Every launch the benchmark times, with the hardware cast, on the outliers and non-finite values (rceil,
    where direct_inverse applies, and floor)."""
    for chunk_d, scaling in ((128, "rceil"), (64, "rceil"), (128, "floor")):
        _check_every_byte(mixed_batch, dtype, scaling, 4, 128, chunk_d=chunk_d, **opts._asdict())


def _check_every_byte(mixed_batch, dtype, scaling, heads, dim, **launch_options):
    values, offsets = mixed_batch(heads, dim, dtype)
    values, offsets = values.cuda(), offsets.cuda()
    layout = JaggedLayout.from_offsets(offsets, values)
    t, h, d = values.shape
    hdim_bytes, seq_bytes = scale_sizes(layout.padded_total, d)
    payloads = {o: torch.full((t, h, d), 0xA5, dtype=torch.uint8, device="cuda").view(PAYLOAD_DTYPE) for o in ALL}
    scales = {n: torch.full((h, nb), 0xA5, dtype=torch.uint8, device="cuda") for n, nb in
              (("hdim", hdim_bytes), ("seq", seq_bytes), ("square_hdim", hdim_bytes), ("square_seq", seq_bytes))}
    launch(values, layout.offsets, layout.scale_offsets, layout.tile_seq, layout.padded_total, payloads, scales,
           scaling == "rceil", tile_tokens=layout.tile_tokens, **launch_options)
    ref = quantize_jagged(values, layout, ALL, scaling=scaling, backend="reference")
    ours = type(ref)(layout, scaling, values.dtype, h, d, payloads["hdim"], payloads["seq"], payloads["square"],
                     scales["hdim"], scales["seq"], scales["square_hdim"], scales["square_seq"])
    assert_same_bytes(ours, ref)


def test_int32_offsets_and_inductor_compile(mixed_batch):
    values, offsets = mixed_batch(4, 128, torch.bfloat16, offsets_dtype=torch.int32)
    values, offsets = values.cuda(), offsets.cuda()
    layout = JaggedLayout.from_offsets(offsets, values)

    def fn(v):
        jmx = quantize_jagged(v, layout, ALL, backend="triton")
        return [getattr(jmx, n) for n in OUTPUTS]

    got = torch.compile(fn, fullgraph=True)(values)
    ref = quantize_jagged(values, layout, ALL, backend="reference")
    for name, g in zip(OUTPUTS, got):
        assert torch.equal(g.view(torch.uint8), getattr(ref, name).view(torch.uint8)), name


def test_host_syncs(mixed_batch):
    """At most one host sync to build a layout; none to build one from precomputed ints, to quantize with
    a built layout, or to dequantize."""
    values, offsets = mixed_batch(2, 64, torch.bfloat16)
    values, offsets = values.cuda(), offsets.cuda()
    layout = JaggedLayout.from_offsets(offsets, values)
    quantize_jagged(values, layout, ALL)  # compile the kernel outside the checks
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            JaggedLayout.from_offsets(offsets, values)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # one warning per synchronizing call; the mode's own "prototype feature" notice is not a sync
    syncs = [w for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in caught]  # 0 would mean the check saw nothing
    torch.cuda.set_sync_debug_mode("error")
    try:
        fast = JaggedLayout.from_offsets(offsets, values, max_len=layout.max_len, padded_total=layout.padded_total)
        jmx = quantize_jagged(values, fast, ALL)
        for o in ALL:
            dequantize_jagged(jmx, o)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_repeated_calls_launch_the_compiled_kernel_directly(mixed_batch, monkeypatch):
    """After the first call of a plan, calls go to the compiled kernel's launcher
    (skipping the JIT): the same bytes on every call, for values 2 bytes off 16-byte alignment (another
    specialization, through the JIT again), with another dtype, on a side stream and replayed from a CUDA graph."""
    import gem_lp.jagged.kernels.triton_quantize as tk

    values, offsets = mixed_batch(4, 128, torch.bfloat16)
    values, offsets = values.cuda(), offsets.cuda()
    layout = JaggedLayout.from_offsets(offsets, values)
    ref = quantize_jagged(values, layout, ALL, backend="reference")
    for _ in range(3):
        assert_same_bytes(quantize_jagged(values, layout, ALL, backend="triton"), ref)
    payloads, scales = tk._allocate(values, layout.padded_total, True, True, True)
    plan = tk._plan_and_args(values, layout.offsets, layout.scale_offsets, layout.tile_seq, layout.padded_total,
                             payloads, scales, True, tile_tokens=layout.tile_tokens)[2]
    assert plan.launch.compiled, "no compiled kernel recorded for direct launches"
    shifted = torch.empty(values.numel() + 1, dtype=values.dtype, device="cuda")[1:].view(values.shape)
    shifted.copy_(values)
    assert shifted.data_ptr() % 16 != 0
    for _ in range(2):
        assert_same_bytes(quantize_jagged(shifted, layout, ALL, backend="triton"), ref)
    wide = values.float()
    ref_wide = quantize_jagged(wide, layout, ALL, backend="reference")
    for _ in range(2):
        assert_same_bytes(quantize_jagged(wide, layout, ALL, backend="triton"), ref_wide)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = quantize_jagged(values, layout, ALL, backend="triton")
    torch.cuda.current_stream().wait_stream(side)
    assert_same_bytes(got, ref)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = quantize_jagged(values, layout, ALL, backend="triton")
    for name in OUTPUTS:
        getattr(captured, name).view(torch.uint8).fill_(0xA5)
    graph.replay()
    torch.cuda.synchronize()
    assert_same_bytes(captured, ref)

