"""The CPU models of the sm_100a MXFP8 attention kernels (`gem_lp.attention.cute.sm100_model`) against the reference
recipe, and the pieces of the kernels' schedules they execute: FA4's varlen tile map, the tensor-memory plan, the
scale-tile reads, the block-scaled MMA. Operands come from `quantize_jagged` (zero-gather payloads, per-sequence
128-padded blocked scales), inputs are BF16 so that O and the gradients of model and reference are both BF16."""
import math
import types
import warnings

import pytest
import torch

from gem_lp.accuracy import sqnr_db
from gem_lp.attention.cute import sm100_model
from gem_lp.attention.cute.model import backward as bwd_model
from gem_lp.attention.cute.model import forward as fwd_model
from gem_lp.attention.cute.model.mma import TmemLedger, block_scaled_mma, scale_tile
from gem_lp.attention.cute.sm100_operands import check_sm100_operands
from gem_lp.attention.cute.model.scheduler import CU_TILES_ABOVE, make_scheduler, tile_cumsum
from gem_lp.attention.layout import make_plan
from gem_lp.attention.reference import DQAccumulatorOverflow, MXRecipe, attention_reference
from gem_lp.jagged import dequantize_jagged, quantize_jagged
from gem_lp.mx.layout import blocked_index

# every length class at a tile or MX-block edge, and an empty sequence
LENGTHS = (0, 1, 31, 32, 33, 127, 128, 129, 255, 257)
HEADS = 2
O_DB, GRAD_DB = 60.0, 50.0


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: a second thread only contends on the shared cores
    yield
    torch.set_num_threads(threads)


def _scales(**fields):
    """`launch.MXScales` / `MXBwdScales` where the CuTe stack is installed, else a namespace with their fields."""
    try:
        from gem_lp.attention.cute.launch import MXBwdScales, MXScales
    except ImportError:
        return types.SimpleNamespace(**fields)
    return (MXBwdScales if "q_seq" in fields else MXScales)(**fields)


def _batch(q_lengths, kv_lengths=None, *, dim, seed=0):
    kv_lengths = q_lengths if kv_lengths is None else kv_lengths
    g = torch.Generator().manual_seed(seed)
    q_offs = torch.tensor([0, *q_lengths], dtype=torch.int64).cumsum(0)
    kv_offs = torch.tensor([0, *kv_lengths], dtype=torch.int64).cumsum(0)
    tq, tk = int(q_offs[-1]), int(kv_offs[-1])
    q, do = (torch.randn(tq, HEADS, dim, generator=g).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(tk, HEADS, dim, generator=g).to(torch.bfloat16) for _ in range(2))
    dlse = torch.randn(tq, HEADS, generator=g)
    return q, k, v, do, dlse, q_offs, kv_offs


def _tiles(jmx):
    return (jmx.layout.scale_offsets // 128).to(torch.int32)


def _reference(q, k, v, do, dlse, q_offs, kv_offs, *, causal, p_quant, recipe=None, grads=True):
    plan = make_plan(q_offs, kv_offs, broadcast_q=False, q_len=q.shape[0], heads=HEADS)
    leaves = [t.clone().requires_grad_(grads) for t in (q, k, v)]
    recipe = recipe or MXRecipe(p_quant=p_quant)
    o, lse = attention_reference(*leaves, plan, causal=causal, precision="mxfp8", scale=q.shape[-1] ** -0.5,
                                 recipe=recipe, p_quant=recipe.p_quant)
    if not grads:
        return o.detach(), lse.detach(), None
    # dLSE through the LSE term wherever the LSE is finite (a row without keys has none)
    dlse = torch.where(torch.isfinite(lse), dlse, torch.zeros(()))
    d = torch.autograd.grad((o, lse), leaves, (do, dlse), allow_unused=True)
    d = [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, d)]
    return o.detach(), lse.detach(), (d, dlse)


def _model_forward(q, k, v, q_offs, kv_offs, *, causal, p_quant):
    jq, jk, jv = quantize_jagged(q, q_offs, ("hdim",)), quantize_jagged(k, kv_offs, ("hdim",)), \
        quantize_jagged(v, kv_offs, ("seq",))
    scales = _scales(q=jq.scale_hdim, k=jk.scale_hdim, v=jv.scale_seq, q_tiles=_tiles(jq), k_tiles=_tiles(jk))
    return sm100_model.forward_trace(jq.payload_hdim, jk.payload_hdim, jv.payload_seq, scales,
                                     q_offs.to(torch.int32), kv_offs.to(torch.int32), causal=causal,
                                     scale=q.shape[-1] ** -0.5, p_quant=p_quant)


def _model_backward(q, k, v, do, out, lse, dlse, q_offs, kv_offs, *, causal, p_quant, **kw):
    jq, jk, jdo = (quantize_jagged(t, o, ("square",)) for t, o in ((q, q_offs), (k, kv_offs), (do, q_offs)))
    jv = quantize_jagged(v, kv_offs, ("hdim",))
    scales = _scales(q=jq.scale_square_hdim, q_seq=jq.scale_square_seq, k=jk.scale_square_hdim,
                     k_seq=jk.scale_square_seq, v=jv.scale_hdim, do=jdo.scale_square_hdim,
                     do_seq=jdo.scale_square_seq, q_tiles=_tiles(jq), k_tiles=_tiles(jk))
    do_values = dequantize_jagged(jdo, "square").to(torch.bfloat16)
    return sm100_model.backward_trace(jq.payload_square, jk.payload_square, jv.payload_hdim, jdo.payload_square,
                                      do_values, out, lse.T.contiguous(), dlse.T.contiguous(), scales,
                                      q_offs.to(torch.int32), kv_offs.to(torch.int32), causal=causal,
                                      scale=q.shape[-1] ** -0.5, p_quant=p_quant, **kw)


def _check_forward(trace, o_ref, lse_ref):
    o_db = sqnr_db(trace.out.float(), o_ref.float())
    lse = trace.lse.T
    finite = torch.isfinite(lse_ref)
    assert torch.equal(torch.isfinite(lse), finite), "rows without a visible key differ"
    assert torch.all(trace.out.float()[~finite] == 0)
    lse_db = sqnr_db(lse[finite], lse_ref[finite])
    assert o_db >= O_DB and lse_db >= O_DB, (o_db, lse_db)
    return o_db, lse_db


@pytest.mark.parametrize("p_quant", ["const_p", "dynamic"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dim", [64, 128])
def test_forward_model_matches_reference(dim, causal, p_quant):
    q, k, v, _, _, offs, _ = _batch(LENGTHS, dim=dim, seed=dim + causal)
    trace = _model_forward(q, k, v, offs, offs, causal=causal, p_quant=p_quant)
    o_ref, lse_ref, _ = _reference(q, k, v, None, None, offs, offs, causal=causal, p_quant=p_quant, grads=False)
    _check_forward(trace, o_ref, lse_ref)
    assert not [r for r in trace.scale_reads if not r[2]]
    # one tile per (128-query block, head) of every sequence
    assert len(trace.tiles) == HEADS * sum(math.ceil(n / 128) for n in LENGTHS)


@pytest.mark.parametrize("p_quant", ["const_p", "dynamic"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dim", [64, 128])
def test_backward_model_matches_reference(dim, causal, p_quant):
    q, k, v, do, dlse, offs, _ = _batch(LENGTHS, dim=dim, seed=10 + dim + causal)
    out, lse, ((dq, dk, dv), dlse) = _reference(q, k, v, do, dlse, offs, offs, causal=causal, p_quant=p_quant)
    trace = _model_backward(q, k, v, do, out, lse, dlse, offs, offs, causal=causal, p_quant=p_quant)
    got = [sqnr_db(a.float(), b.float()) for a, b in ((trace.dq, dq), (trace.dk, dk), (trace.dv, dv))]
    assert min(got) >= GRAD_DB, got
    assert not [r for r in trace.scale_reads if not r[2]]
    # the empty and single-token sequences' rows are there too: every gradient row finite
    assert all(torch.isfinite(t.float()).all() for t in (trace.dq, trace.dk, trace.dv))


def test_more_than_256_sequences():
    """Above 256 sequences FA4's scheduler takes the launcher's cumulative tile counts and binary-searches them; the
    tile map and the results are those of the scan without them."""
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, 40, (300,), generator=g).tolist()
    lengths[0], lengths[-1] = 0, 129
    q, k, v, do, dlse, offs, _ = _batch(lengths, dim=64, seed=4)
    out, lse, ((dq, dk, dv), dlse) = _reference(q, k, v, do, dlse, offs, offs, causal=True, p_quant="dynamic")
    trace = _model_forward(q, k, v, offs, offs, causal=True, p_quant="dynamic")
    _check_forward(trace, out, lse)
    btrace = _model_backward(q, k, v, do, out, lse, dlse, offs, offs, causal=True, p_quant="dynamic")
    got = [sqnr_db(a.float(), b.float()) for a, b in ((btrace.dq, dq), (btrace.dk, dk), (btrace.dv, dv))]
    assert min(got) >= GRAD_DB, got
    cu = offs.tolist()
    for lpt in (False, True):
        hinted = make_scheduler(cu, num_head=HEADS, tile_m=128, tile_n=128, head_dim=64, lpt=lpt)
        assert hinted.cu_tiles is not None and len(cu) - 1 > CU_TILES_ABOVE
        scanned = hinted.__class__(**{**hinted.__dict__, "cu_tiles": None})
        assert [hinted.decode(i) for i in range(hinted.grid())] == [scanned.decode(i) for i in range(hinted.grid())]


def test_same_query_length_for_every_sequence():
    """Broadcast-style batches: every query sequence of one length, the keys jagged (cross-attention offsets)."""
    q_len = (48,) * 6
    kv_len = (1, 200, 64, 129, 31, 300)
    q, k, v, do, dlse, q_offs, kv_offs = _batch(q_len, kv_len, dim=128, seed=5)
    for causal in (False, True):
        out, lse, ((dq, dk, dv), dlse_used) = _reference(q, k, v, do, dlse, q_offs, kv_offs, causal=causal,
                                                         p_quant="const_p")
        _check_forward(_model_forward(q, k, v, q_offs, kv_offs, causal=causal, p_quant="const_p"), out, lse)
        trace = _model_backward(q, k, v, do, out, lse, dlse_used, q_offs, kv_offs, causal=causal, p_quant="const_p")
        got = [sqnr_db(a.float(), b.float()) for a, b in ((trace.dq, dq), (trace.dk, dk), (trace.dv, dv))]
        assert min(got) >= GRAD_DB, (causal, got)


def test_keys_of_the_first_sequence_missing():
    """Cross-attention where the first sequence has queries and no keys: the kernels still run one all-masked key
    tile for it, with K's scale tile index k_tiles[0] - 1 = -1, which the forward clamps into the buffer (no
    out-of-bounds load); O is 0 and the LSE -inf there, as in the reference."""
    q, k, v, do, dlse, q_offs, kv_offs = _batch((40, 70), (0, 90), dim=64, seed=6)
    out, lse, _ = _reference(q, k, v, do, dlse, q_offs, kv_offs, causal=False, p_quant="const_p", grads=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", sm100_model.ScaleTileOutOfBounds)
        trace = _model_forward(q, k, v, q_offs, kv_offs, causal=False, p_quant="const_p")
    _check_forward(trace, out, lse)
    assert torch.all(trace.out[:40] == 0) and torch.all(trace.lse[:, :40] == -math.inf)


def test_scale_buffers_of_ceil_t_over_128_tiles_are_too_short():
    """The per-sequence padding needs sum ceil(L_b / 128) scale tiles, up to (T + 127 B) / 128: 40 sequences of 3
    tokens need 40 tiles, and the backward reads tiles 1-39 past the end of a buffer of ceil(T / 128) = 1 (the
    launchers check the buffers against the tiles the offsets need, `sm100_operands`)."""
    q, k, v, _, _, offs, _ = _batch((3,) * 40, dim=64, seed=11)
    jq, jk, jv = quantize_jagged(q, offs, ("hdim",)), quantize_jagged(k, offs, ("hdim",)), \
        quantize_jagged(v, offs, ("seq",))
    tiles = math.ceil(q.shape[0] / 128)
    short = dict(q=jq.scale_hdim[:, :512 * tiles].contiguous(), k=jk.scale_hdim[:, :512 * tiles].contiguous(),
                 v=jv.scale_seq[:, :512 * tiles].contiguous())
    scales = _scales(**short, q_tiles=_tiles(jq), k_tiles=_tiles(jk))
    cu = offs.to(torch.int32)
    with pytest.raises(ValueError, match="scales.q holds 1 scale tiles per head, fewer than the 40 its offsets need"):
        check_sm100_operands(jq.payload_hdim, jk.payload_hdim, jv.payload_seq, scales, cu, cu)


def test_scale_buffers_at_the_bound_pass_without_reading_the_offsets(monkeypatch):
    """Buffers of ceil(T / 128) + B tiles (what `JaggedLayout.bounded` allots) hold any offsets' tiles: the check
    passes without reading `tiles[-1]` (no host sync on the producer's path)."""
    from gem_lp.attention.cute import sm100_operands

    q, k, v, _, _, offs, _ = _batch((3,) * 40, dim=64, seed=11)
    jq, jk, jv = quantize_jagged(q, offs, ("hdim",)), quantize_jagged(k, offs, ("hdim",)), \
        quantize_jagged(v, offs, ("seq",))
    bound = math.ceil(q.shape[0] / 128) + 40
    assert jq.scale_hdim.shape[1] // 512 <= bound
    pad = [torch.nn.functional.pad(t, (0, 512 * bound - t.shape[1])) for t in (jq.scale_hdim, jk.scale_hdim,
                                                                             jv.scale_seq)]
    scales = _scales(q=pad[0], k=pad[1], v=pad[2], q_tiles=_tiles(jq), k_tiles=_tiles(jk))

    def no_read(tiles):
        raise AssertionError("read the offsets")

    monkeypatch.setattr(sm100_operands, "_needed_tiles", no_read)
    cu = offs.to(torch.int32)
    check_sm100_operands(jq.payload_hdim, jk.payload_hdim, jv.payload_seq, scales, cu, cu)


def test_empty_batch():
    q, k, v, do, dlse, offs, _ = _batch((), dim=64)
    out, lse = sm100_model.forward(*(quantize_jagged(t, offs, (o,)).payload(o) for t, o in
                                     ((q, "hdim"), (k, "hdim"), (v, "seq"))),
                                   None, offs.to(torch.int32), offs.to(torch.int32), causal=True, scale=0.125)
    assert out.shape == (0, HEADS, 64) and out.dtype == torch.bfloat16 and lse.shape == (HEADS, 0)
    pay = [quantize_jagged(t, offs, (o,)).payload(o) for t, o in ((q, "square"), (k, "square"), (v, "hdim"),
                                                                 (do, "square"))]
    grads = sm100_model.backward(*pay, do, out, lse, None, None, offs.to(torch.int32), offs.to(torch.int32),
                                 causal=False, scale=0.125, p_quant="dynamic")
    assert all(g.shape == (0, HEADS, 64) for g in grads)


def test_const_p_exp2_is_fa4s_emulation_on_some_keys():
    """const_p's P comes from FA4's exp2, a degree-3 polynomial on 16 (32 for causal D = 128) of each row's 128 keys:
    within 1e-4 of 2^t there, so a few P values round to another E4M3 value than the reference's; dynamic P
    uses the MUFU ex2 throughout."""
    t = torch.linspace(-30.0, 8.0, 100_001)
    rel = (fwd_model.ex2_emulation(t).double() / torch.exp2(t.double()) - 1).abs()
    assert 1e-6 < float(rel.max()) < 1e-4
    for (dim, causal), keys in {(64, False): 16, (64, True): 16, (128, False): 16, (128, True): 32}.items():
        emulated = fwd_model.ex2_emulated_keys(*fwd_model.ex2_emu_config(dim, causal))
        assert int(emulated.sum()) == keys and not emulated[:32].any() and not emulated[96:].any()
    q, k, v, _, _, offs, _ = _batch((300,), dim=128, seed=9)
    exact = torch.zeros(128, dtype=torch.bool)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fwd_model, "ex2_emulated_keys", lambda *a: exact)
        mufu = _model_forward(q, k, v, offs, offs, causal=True, p_quant="const_p")
    fa4 = _model_forward(q, k, v, offs, offs, causal=True, p_quant="const_p")
    assert not torch.equal(mufu.out, fa4.out) and sqnr_db(fa4.out.float(), mufu.out.float()) > O_DB


# ----------------------------------------------------------------------------- the dQ accumulator


def test_fp16_dq_accumulator():
    """MXRecipe(dq_accum="fp16"): the model's FP16 accumulator (per key tile, scale 2^12) against the reference's, and
    beside the FP32 one; a dQ beyond 65504 * 2^-12 raises in both."""
    q, k, v, do, dlse, offs, _ = _batch(LENGTHS, dim=128, seed=7)
    recipe = MXRecipe(dq_accum="fp16")
    out, lse, ((dq16, _, _), dlse16) = _reference(q, k, v, do, dlse, offs, offs, causal=True, p_quant="const_p",
                                                  recipe=recipe)
    _, _, ((dq32, _, _), _) = _reference(q, k, v, do, dlse, offs, offs, causal=True, p_quant="const_p")
    trace = _model_backward(q, k, v, do, out, lse, dlse16, offs, offs, causal=True, p_quant="const_p",
                            dq_accum="fp16")
    assert sqnr_db(trace.dq.float(), dq16.float()) >= GRAD_DB
    assert sqnr_db(dq16.float(), dq32.float()) >= 40.0  # FP16's 11 bits on values far inside its range
    assert not torch.equal(dq16, dq32)
    big = do * 64.0  # dS, and dQ with it, 64 times larger: beyond 65504 * 2^-12 = 16
    with pytest.raises(DQAccumulatorOverflow, match="static scale 2\\^12"):
        _reference(q, k, v, big, dlse, offs, offs, causal=True, p_quant="const_p", recipe=recipe)
    with pytest.raises(DQAccumulatorOverflow):
        _model_backward(q, k, v, big, out, lse, dlse16, offs, offs, causal=True, p_quant="const_p", dq_accum="fp16")
    # a smaller static scale holds it
    _reference(q, k, v, big, dlse, offs, offs, causal=True, p_quant="const_p",
               recipe=MXRecipe(dq_accum="fp16", dq_scale_log2=4))
    with pytest.raises(ValueError, match="dq_accum must be one of"):
        MXRecipe(dq_accum="bf16")


def test_fp16_dq_range_at_2_pow_12():
    """The error budget's check of LP-FA4's static 2^12 (|dQ| < 16): randn fits, shared outlier channels x20 do not."""
    from gem_lp.attention.error_budget import INPUT_KINDS, dq_fp16_range

    rows = dq_fp16_range(kinds=(INPUT_KINDS[0], INPUT_KINDS[2]), causals=(False,))
    assert [(r["input"], r["fits"]) for r in rows] == [("randn", True), ("channels x20", False)]
    assert rows[1]["dq_max"] > rows[1]["limit"] == 65504.0 / 4096


# ----------------------------------------------------------------------------- schedule pieces


def test_tile_map_order_and_coverage(monkeypatch):
    cu = [0, 0, 300, 301, 700, 700, 1000]
    plain = make_scheduler(cu, num_head=3, tile_m=128, tile_n=128, head_dim=128, lpt=False)
    tiles = plain.tiles()  # asserts every (block, head, batch) exactly once
    assert plain.grid() == (1000 + 6 * 127) // 128 * 3
    # a batch's tiles are contiguous, head-major, blocks ascending
    assert [(t.head, t.block) for t in tiles if t.batch == 1] == [(h, b) for h in range(3) for b in range(3)]
    lpt = make_scheduler(cu, num_head=3, tile_m=128, tile_n=128, head_dim=128, lpt=True).tiles()
    assert [(t.head, t.block) for t in lpt if t.batch == 1] == [(h, b) for b in (2, 1, 0) for h in range(3)]
    assert tile_cumsum(cu, 128) == [0, 0, 3, 4, 8, 8, 11]
    decode = type(plain).decode
    monkeypatch.setattr(type(plain), "decode", lambda self, i: None if i == 5 else decode(self, i))
    with pytest.raises(AssertionError, match="tile map: 32 tiles for 33"):
        plain.tiles()


@pytest.mark.parametrize("dim", [64, 128])
def test_backward_tensor_memory_plan(dim):
    """The scale tiles' columns (bwd_sm100.__init__) and the MMA warp's order keep every region intact until its last
    reader, within the 512 columns; a plan with V's scale tile over P's columns is caught."""
    cols = bwd_model.tmem_columns(dim)
    serial = bwd_model.serial_schedule(dim)
    assert serial == (dim == 128)
    sf = sorted(cols[f"sf{n}"][0] for n in bwd_model.SF_TILES)
    assert sf == (list(range(384, 424, 4)) if dim == 64 else list(range(32, 64, 4)) + [288, 292])
    for steps in (1, 3):
        ledger = TmemLedger(512)
        bwd_model._schedule_events(ledger, cols, steps, serial)
        assert max(s + n for _, _, s, n in ledger.events) <= 512
    bad = dict(cols, sfVh=(16, 4))
    with pytest.raises(AssertionError, match="read after .*overwrote it"):
        bwd_model._schedule_events(TmemLedger(512), bad, 2, serial)
    # K's hdim tile copied over dV's columns between two accumulating dV MMAs
    with pytest.raises(AssertionError, match="(dV \\(columns 128-|sfKh \\(columns 128-131\\)).* read after"):
        bwd_model._schedule_events(TmemLedger(512), dict(cols, sfKh=(128, 4)), 3, serial)


def test_forward_tensor_memory_plan():
    for dim in (64, 128):
        cols = fwd_model.tmem_columns(dim, dynamic_p=True)
        assert cols["O"] == (256, dim) and cols["P"] == (64, 32)
        assert [cols[n][0] for n in ("sfQ", "sfK", "sfP", "sfV")] == [256 + dim + 4 * i for i in range(4)]
    with pytest.raises(AssertionError, match="outside the 512"):
        TmemLedger(512).write("O", 448, 128)


def test_scale_tile_reads_the_blocked_layout():
    """The MMA warp's 16-byte lane reads of a tile, seen through the scale-factor atom, give scale (row, column) of
    the blocked layout (docs/numerics.md) for rows 128 t .. 128 t + 127."""
    rows, cols = 384, 4
    plain = torch.randint(0, 255, (rows, cols), dtype=torch.uint8)
    blocked = torch.zeros(1, rows // 128 * 512, dtype=torch.uint8)
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    blocked[0, blocked_index(r, c, cols)] = plain
    reads = []
    for t in range(3):
        assert torch.equal(scale_tile(blocked, 0, t, reads, "x"), plain[128 * t:128 * (t + 1)])
    assert torch.all(scale_tile(blocked, 0, 3, reads, "x") == 255) and reads[-1] == ("x", 3, False)


def test_block_scaled_mma():
    """Per 32-element K block: exact products of E4M3 values times 2^(byte - 127), FP32 accumulation; byte 255 NaN."""
    g = torch.Generator().manual_seed(8)
    a = torch.randn(16, 96, generator=g).to(torch.float8_e4m3fn).float()
    b = torch.randn(8, 96, generator=g).to(torch.float8_e4m3fn).float()
    sfa = torch.randint(110, 140, (16, 3), generator=g, dtype=torch.uint8)
    sfb = torch.randint(110, 140, (8, 3), generator=g, dtype=torch.uint8)
    got = block_scaled_mma(a, sfa, b, sfb)
    deq = lambda x, s: x * torch.exp2(s.double() - 127).repeat_interleave(32, 1)  # noqa: E731
    torch.testing.assert_close(got.double(), deq(a, sfa) @ deq(b, sfb).T, rtol=1e-5, atol=1e-5)
    sfa[3, 1] = 255
    nan = block_scaled_mma(a, sfa, b, sfb)
    assert torch.isnan(nan[3]).all() and not torch.isnan(nan[:3]).any()


# ----------------------------------------------------------------------------- the layouts the model assumes


_PROBE = '''
import json, os, sys
os.environ["CUTE_DSL_ARCH"] = "sm_100a"
import cutlass, cutlass.cute as cute
from cutlass import Float32
from cutlass.cute.nvgpu import tcgen05
from flash_attn.cute import copy_utils as fa4_copy
from gem_lp.attention.cute.bwd_sm100 import MXAttentionBackwardSm100
from gem_lp.attention.cute.fwd_sm100 import MXAttentionForwardSm100
out = {}

@cute.jit
def bwd(kernel: cutlass.Constexpr):
    (kernel.tiled_mma_S, kernel.tiled_mma_dP, kernel.tiled_mma_dK, kernel.tiled_mma_dV,
     kernel.tiled_mma_dQ) = kernel._get_tiled_mma()
    mma_S = kernel.tiled_mma_S
    tScS = mma_S.get_slice(0).partition_C(cute.make_identity_tensor(kernel.mma_tiler_kq[:2]))
    tScP = cute.composition(tScS, (cute.make_layout((kernel.tile_n, 32)), 1, 1))
    ld = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32)
    st = cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(8)), Float32)
    for t in cutlass.range_constexpr(256):
        c = fa4_copy.make_tmem_copy(ld, 2).get_slice(t).partition_D(tScS)
        p = fa4_copy.make_tmem_copy(st, 2).get_slice(t).partition_S(tScP)
        out[f"bwd {t}"] = [[[int(x) for x in c[i, s, 0, 0]] for i in range(32)] for s in range(2)]
        out[f"bwdP {t}"] = [[[int(x) for x in p[i, s, 0, 0]] for i in range(8)] for s in range(2)]
    out["sf"] = [str(smem) for smem, _ in kernel._sf_layouts().values()]

@cute.jit
def fwd(kernel: cutlass.Constexpr):
    mx = kernel._mx_mmas()
    thr = mx["mma_qk"].get_slice(0)
    tStS = thr.make_fragment_C(thr.partition_shape_C(kernel.mma_tiler_qk[:2]))
    acc = cute.make_tensor(cute.make_ptr(Float32, 0, mem_space=cute.AddressSpace.tmem, assumed_align=16),
                           tStS.layout)[(None, None), 0, 0]
    tScS = thr.partition_C(cute.make_identity_tensor(kernel.mma_tiler_qk[:2]))[(None, None), 0, 0]
    ld = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32)
    for t in (0, 5, 37, 127):
        c = tcgen05.make_tmem_copy(ld, acc).get_slice(t).partition_D(tScS)
        out[f"fwd {t}"] = [[int(x) for x in c[i, 0, j]] for j in range(4) for i in range(32)]
    out["fwd sf"] = [str(mx[n]) for n in ("sfq_smem", "sfkv_smem", "sfv_smem", "sfp_smem")]

bwd(MXAttentionBackwardSm100(128, is_causal=True, p_quant="dynamic"))
k = MXAttentionForwardSm100(64, is_causal=False, p_quant="dynamic")
k.kv_stage = 2
fwd(k)
json.dump(out, open(sys.argv[1], "w"))
'''


@pytest.mark.slow
def test_thread_and_scale_layouts_the_model_assumes(tmp_path):
    """Traced for sm_100a (child process): FA4's compute-warp thread t holds key t % 128 and per stage s queries
    64 s + 32 (t // 128) + [0, 32), and its E4M3 P word w of stage s lands at column 16 s + 8 (t // 128) + w (the
    queries of its bytes); the forward's softmax thread t holds row t, keys in register order; every scale tile's
    shared-memory layout is the 128x4 atom `mma.sf_atom_offset` reads."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("flash_attn.cute")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    probe = tmp_path / "probe.py"
    probe.write_text(_PROBE)
    done = subprocess.run([sys.executable, str(probe), str(tmp_path / "out.json")], cwd=root, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "PYTHONPATH": root, "TRITON_INTERPRET": "0"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = json.loads((tmp_path / "out.json").read_text())
    for t in range(256):
        for s in range(2):
            queries = [64 * s + 32 * (t // 128) + j for j in range(32)]
            assert got[f"bwd {t}"][s] == [[t % 128, qq] for qq in queries]
            assert got[f"bwdP {t}"][s] == [[t % 128, 16 * s + 8 * (t // 128) + w] for w in range(8)]
    for t in (0, 5, 37, 127):
        assert got[f"fwd {t}"] == [[t, key] for key in range(128)]
    atom = "((((32,4),1),(32,1)),1,4,{}):((((16,4),0),(0,0)),0,1,512)"
    assert got["sf"] == [atom.format(1)] * 10
    assert got["fwd sf"] == [atom.format(n) for n in (1, 2, 2, 1)]


def test_model_needs_no_cute_stack():
    """The models import without the CuTe DSL (plain PyTorch), so CPU-only users can run them."""
    import subprocess
    import sys

    code = ("import sys; import gem_lp.attention.cute.sm100_model; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('cutlass', 'flash_attn', 'quack')]; "
            "sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert sm100_model.__all__
