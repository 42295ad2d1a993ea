"""The PTX of every sm_100a attention build (`gem_lp.compile_check`'s attention targets), read back: every MMA of the
MXFP8 kernels block-scaled with the shape, operand majorness, tensor-memory columns and scale-factor bytes of its
GEMM, each TMA stage's expect_tx byte count equal to the bytes its loads carry, the tensor-memory allocation, and
ptxas's registers and spills.

The PTX comes from `$GEM_LP_COMPILE_DUMP/sm_100a` when the variable is set (`make test` runs compile_check first;
one directory per build), else from building the targets once in a child process (minutes: the tests are then
`slow`)."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from gem_lp.attention.cute import ptx_checks as pc
from gem_lp.attention.cute.model import backward as bwd_model
from gem_lp.attention.cute.model import forward as fwd_model

DUMP_ENV = "GEM_LP_COMPILE_DUMP"
pytestmark = [] if os.environ.get(DUMP_ENV) else [pytest.mark.slow]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def ptx_by_build(tmp_path_factory):
    """label -> PTX paths of the sm_100a attention builds."""
    given = os.environ.get(DUMP_ENV)
    if given:
        files = pc.ptx_files(os.path.join(given, "sm_100a"))
    else:
        pytest.importorskip("flash_attn.cute")
        dump = str(tmp_path_factory.mktemp("sm100_attention_ptx"))
        done = subprocess.run([sys.executable, "-m", "gem_lp.attention.cute.ptx_checks", "--arch", "sm_100a",
                               "--dump-dir", dump], cwd=ROOT, capture_output=True, text=True, timeout=1800,
                              env={**os.environ, "PYTHONPATH": ROOT, "TRITON_INTERPRET": "0"})
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        files = pc.ptx_files(dump)
    files = {label: paths for label, paths in files.items() if label.startswith("attention-")}
    if not any(files.values()):
        pytest.skip(f"no PTX in {given}")
    return files


def _kernels(ptx_by_build, name):
    return [(label, path) for label, paths in ptx_by_build.items() for path in paths if pc.kernel_name(path) == name]


def _head_dim(mmas) -> int:
    return min(m.idesc["n"] for m in mmas)  # P V / dV / dK / dQ have N = D, the score GEMMs N = 128


def _gemms(kernel: str, dim: int) -> dict:
    """name -> (D column, N, A's majorness, A's tensor-memory column or None, B's majorness, K blocks, SFA column,
    SFB column), from the models' tensor-memory plans (forward: one Q stage)."""
    if kernel == "MXAttentionForwardSm100":
        c = fwd_model.tmem_columns(dim, dynamic_p=True)
        return {
            "S = Q K^T": (c["S"][0], 128, "K", None, "K", dim // 32, c["sfQ"][0], c["sfK"][0]),
            "O += P V": (c["O"][0], dim, "K", c["P"][0], "MN", 4, c["sfP"][0], c["sfV"][0]),
        }
    c = bwd_model.tmem_columns(dim)
    sf = lambda n: c[f"sf{n}"][0]  # noqa: E731
    return {
        "S^T = K Q^T": (c["S"][0], 128, "K", None, "K", dim // 32, sf("Kh"), sf("Qh")),
        "dP^T = V dO^T": (c["dP"][0], 128, "K", None, "K", dim // 32, sf("Vh"), sf("dOh")),
        "dV += P^T dO": (c["dV"][0], dim, "K", c["P"][0], "MN", 4, sf("P"), sf("dOs")),
        "dK += dS^T Q": (c["dK"][0], dim, "K", c["dS"][0], "MN", 4, sf("dSt"), sf("Qs")),
        "dQ = dS K": (c["dQ"][0], dim, "MN", None, "MN", 4, sf("dS"), sf("Ks")),
    }


def _classify(mma, gemms) -> str:
    hits = [name for name, (d, n, a_major, a_tmem, _, _, _, _) in gemms.items()
            if mma.d_col == d and mma.idesc["n"] == n and mma.idesc["a_major"] == a_major
            and mma.a_tmem == (a_tmem is not None)]
    assert len(hits) == 1, (mma, hits)
    return hits[0]


@pytest.mark.parametrize("kernel", ["MXAttentionForwardSm100", "MXAttentionBackwardSm100"])
def test_mx_mmas(ptx_by_build, kernel):
    """Every tcgen05.mma is cta_group::1 kind::mxf8f6f4.block_scale (E4M3 x E4M3, UE8M0 scales, M = 128); each GEMM
    is issued at two sites as one run of MMAs per 32-wide K block, with its D, N, operand majorness and sources, its
    A column advancing 8 columns (32 E4M3) a block when A is in tensor memory, and its scale factors in the columns
    of the models' plans, byte k of the 4-column tile for K block k (address and descriptor alike)."""
    builds = _kernels(ptx_by_build, kernel)
    assert builds, f"no {kernel} PTX"
    for label, path in builds:
        mmas = pc.mma_instructions(open(path).read())
        assert mmas and all(m.kind == "mxf8f6f4" and m.block_scale and m.cta_group == 1 for m in mmas), label
        assert all(m.idesc and m.idesc["m"] == 128 and m.idesc["ue8m0"] and m.idesc["a_type"] == 0
                   and m.idesc["b_type"] == 0 and not m.idesc["neg_a"] and not m.idesc["neg_b"] for m in mmas), label
        dim = _head_dim(mmas)
        assert dim in (64, 128) and f"d{dim}" in label or label.endswith(".ptx"), (label, dim)
        gemms = _gemms(kernel, dim)
        runs: list[list] = []
        for m in mmas:
            name = _classify(m, gemms)
            k = len(runs[-1][1]) if runs and runs[-1][0] == name and len(runs[-1][1]) < gemms[name][5] else 0
            if k == 0:
                runs.append((name, []))
            runs[-1][1].append(m)
        for name, (d, n, a_major, a_tmem, b_major, blocks, sfa, sfb) in gemms.items():
            mine = [r for r in runs if r[0] == name]
            assert len(mine) == 2 and all(len(r) == blocks for _, r in mine), (label, name, [len(r) for _, r in mine])
            for _, run in mine:
                for k, m in enumerate(run):
                    assert m.idesc["b_major"] == b_major, (label, name)
                    assert m.sfa == (sfa, k) and m.sfb == (sfb, k), (label, name, k, m.sfa, m.sfb)
                    assert m.idesc["sfa_id"] == k and m.idesc["sfb_id"] == k, (label, name, k)
                    if a_tmem is not None:
                        assert m.a_tmem_col == a_tmem + 8 * k, (label, name, k, m.a_tmem_col)


def test_fa4_bf16_mmas_are_not_block_scaled(ptx_by_build):
    builds = _kernels(ptx_by_build, "FlashAttentionForwardSm100") + _kernels(ptx_by_build,
                                                                            "FlashAttentionBackwardSm100")
    assert builds
    for label, path in builds:
        mmas = pc.mma_instructions(open(path).read())
        assert mmas and all(m.kind == "f16" and not m.block_scale for m in mmas), label


@pytest.mark.parametrize("kernel", ["MXAttentionForwardSm100", "MXAttentionBackwardSm100"])
def test_expect_tx_bytes(ptx_by_build, kernel):
    """Each stage's expect_tx byte count equals what its TMA loads carry: a tile of 128 rows x D E4M3 bytes per
    tensor load (a box from feature 0), plus the byte counts of its bulk copies (LSE, Δ rows); stages the load warp
    arms without a load are the pipelines' tails."""
    for label, path in _kernels(ptx_by_build, kernel):
        text = open(path).read()
        dim = _head_dim(pc.mma_instructions(text))
        sites = pc.expect_tx_sites(text)
        loaded = [s for s in sites if s.tensor_loads or s.bulk_bytes]
        assert loaded, label
        for s in loaded:
            assert all(first == 0 for _, first in s.tensor_loads), (label, s)
            assert None not in s.bulk_bytes and s.bytes is not None, (label, s)
            assert s.bytes == 128 * dim * len(s.tensor_loads) + sum(s.bulk_bytes), (label, s)
        tails = [s for s in sites if not (s.tensor_loads or s.bulk_bytes)]
        assert len(tails) <= 2, (label, tails)


def test_const_p_keeps_fa4s_exp2_emulation(ptx_by_build):
    """const_p's softmax runs FA4's exp2 with its polynomial emulation on some keys (the forward model's
    `ex2_emulated_keys`), dynamic P the MUFU ex2 on all: per 128-key softmax step, const_p has that many fewer
    `ex2.approx` and carries the polynomial's coefficients (needs a per-build dump to tell the two apart)."""
    builds = {label: path for label, path in _kernels(ptx_by_build, "MXAttentionForwardSm100")}
    pairs = [(label, label.replace("const_p", "dynamic")) for label in builds if label.endswith("const_p")]
    if not pairs:
        pytest.skip("a flat dump: const_p and dynamic builds share file names")
    for const_label, dyn_label in pairs:
        const_ptx, dyn_ptx = open(builds[const_label]).read(), open(builds[dyn_label]).read()
        dim, causal = int(re.search(r"-d(\d+)-", const_label).group(1)), "-causal" in const_label
        emulated = int(fwd_model.ex2_emulated_keys(*fwd_model.ex2_emu_config(dim, causal)).sum())
        ex2_const, ex2_dyn = const_ptx.count("ex2.approx"), dyn_ptx.count("ex2.approx")
        steps = ex2_dyn // 128  # the softmax loop's step sites
        assert ex2_dyn == 128 * steps and ex2_const == ex2_dyn - emulated * steps, (const_label, ex2_const, ex2_dyn)
        assert "0f3D9DF09D" in const_ptx and "0f3D9DF09D" not in dyn_ptx  # POLY_EX2[3][3] as an FP32 immediate


def test_tensor_memory_allocation(ptx_by_build):
    """Every kernel that allocates tensor memory asks for a power of two of at most 512 columns; the MXFP8 kernels
    for the 512 their plans (and the models' ledgers) use."""
    seen = 0
    for label, paths in ptx_by_build.items():
        for path in paths:
            cols = pc.alloc_columns(open(path).read())
            if not cols:
                continue
            seen += 1
            assert all(c is not None and 32 <= c <= 512 and c & (c - 1) == 0 for c in cols), (label, cols)
            if pc.kernel_name(path).startswith("MXAttention"):
                assert set(cols) == {fwd_model.TMEM_ALLOC} == {bwd_model.TMEM_ALLOC}, (label, cols)
    assert seen


def test_ptxas_registers_and_spills(ptx_by_build):
    """ptxas -v on every PTX (its `.version` lowered where this ptxas is older than the DSL's PTX): the MXFP8 kernels
    use no stack and spill nothing; every kernel's registers are printed."""
    if shutil.which("ptxas") is None:
        pytest.skip("ptxas is not installed (CUDA toolkit): no register or spill report")
    report = []
    for label, paths in sorted(ptx_by_build.items()):
        for path in paths:
            info = pc.ptxas_info(path)
            name = pc.kernel_name(path)
            report.append(f"{label} {name}: {info['registers']} registers, stack {info['stack']}, spills "
                          f"{info['spill_stores']}/{info['spill_loads']}"
                          + (" (PTX version lowered)" if info["version_lowered"] else ""))
            if name.startswith("MXAttention"):
                assert info["stack"] == 0 and info["spill_stores"] == 0 and info["spill_loads"] == 0, report[-1]
    print("\n".join(report))


# ----------------------------------------------------------------------------- the parsers themselves


_SAMPLE = """
	mov.b32 	%r730, 292;
	mov.b32 	%r731, 288;
	mov.pred 	%p284, 0;
	mov.b32 	%r732, 681574416;
	mov.b32 	%r733, 384;
	tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale.block32.collector::a::discard [%r733], [%r7], %rd8, %r732, [%r731], [%r730], %p284;
	mov.b32 	%r352, 16384;
	mbarrier.arrive.expect_tx.shared.b64 %rd239, [%r697], %r352;
	cp.async.bulk.tensor.3d.shared::cta.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint [%r14], [%rd240, {%r354, %r34, %r3387}], [%r697], %rd241;
	mov.b32 	%r365, 512;
	cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%r364], [%rd246], %r365, [%r697];
	mbarrier.try_wait.parity.shared.b64 P1, [%r349], %r350, 10000000;
	mov.b32 	%r558, 512;
	tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 	[%r1+5344], %r558;
"""


def test_parsers_on_a_sample():
    (m,) = pc.mma_instructions(_SAMPLE)
    assert m.d_col == 384 and m.a_tmem and m.a_tmem_col is None and m.sfa == (288, 0) and m.sfb == (292, 0)
    # 681574416 = 0x28A00010: SFB ID 1, N 128, UE8M0, M 128, SFA ID 1, both K-major
    assert m.idesc == dict(sfb_id=1, a_type=0, b_type=0, neg_a=0, neg_b=0, a_major="K", b_major="K", n=128,
                           ue8m0=True, m=128, sfa_id=1)
    assert pc.decode_idesc(681574416 | (1 << 15))["a_major"] == "MN"
    (site,) = pc.expect_tx_sites(_SAMPLE)
    assert site.bytes == 16384 and site.bulk_bytes == [512] and len(site.tensor_loads) == 1
    assert site.tensor_loads[0][1] is None  # %r354 is not a constant in the sample
    assert pc.alloc_columns(_SAMPLE) == [512]
