"""The MX linears on the GPU (fwd+bwd, cuBLAS route) beside BF16 `nn.Linear` at the GPU trainer's shapes.

Run from the project root: `python -m benchmarks.bench_linear` (JSON `bench_linear.json` under $OUT, else
./.bench_out; a short table printed last). All rows run side by side in one process. `--dry-run` (any machine; the
CPU runs the Triton kernels in the interpreter) prints the plan and runs every row once at a tiny token count.

Token counts M: the GPU trainer's own (`trainer=gpu data=synthetic`: a batch's lognormal histories plus its summary
tokens; `common.trainer_token_counts` draws its first batches as the trainer does, about 2.6e5 tokens, never a
multiple of 16), then 32767 and 32768 (a jagged batch's odd count beside the aligned one). Layers (`LAYERS`): the
model's sequence linears at the GPU sizes (d_model 256, MLP hidden 1024: the QKV projection and the MLP's up
projection after an RMSNorm, the attention's output projection, the MLP's down projection, the whole pre-norm MLP)
and the larger widths the kernels are built for (1024 -> 3072, 3072 -> 1024 and their MLP). Each group (a layer at
one M) times, fwd+bwd with BF16 activations and FP32 master weights:

* ours: the MXLinear recipe's autograd Function on the `--route` (default `cublas`, the route of Hopper; `scaled_mm`
  on sm_100): `MXLinearFunction` / `RMSNormMXLinearFunction` / `RMSNormMXMLPFunction` (the MLP op), and the public
  module (`MXLinear` / `RMSNormMXLinear`, `backend="triton"`: argument checks and dispatch included);
* peers: BF16 `nn.Linear` (F.linear on BF16 copies of the parameters), for the norm layers the BF16 composition
  `F.rms_norm` + `nn.Linear`, for the MLP `F.rms_norm` + `nn.Linear` + SiLU + `nn.Linear` (eager and compiled).

Rows hold TF/s (3 GEMMs of 2 M K N flop per layer), the host milliseconds per call (`host_ms_per_call`: above the
row's time, the row measures the host), and `vs_bf16` = BF16 `nn.Linear` (or composition) time / ours. Accuracy, at
each layer's first M: SQNR (dB) of Y and of every gradient against FP32 math for ours and for BF16, and of ours
against the MX reference (`backend="reference"`: the same recipe in plain PyTorch; only FP32 summation orders
differ, so it should be far above the recipe's own error).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: make the project root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if "--dry-run" in sys.argv and not torch.cuda.is_available():  # before gem_lp imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.common import Bench, host_us_per_call, trainer_token_counts  # noqa: E402
from gem_lp.accuracy import sqnr_db  # noqa: E402
from gem_lp.linear import MXLinear, RMSNormMXLinear, mx_linear, rms_norm_mx_linear, rms_norm_mx_mlp  # noqa: E402
from gem_lp.linear.functions import MXLinearFunction, RMSNormMXLinearFunction, RMSNormMXMLPFunction  # noqa: E402
from gem_lp.linear.gemm import ROUTES  # noqa: E402
from gem_lp.linear.operands import clear_weight_cache  # noqa: E402

EPS = 1e-6
SCALING = "rceil"


@dataclasses.dataclass(frozen=True)
class Layer:
    """`kind`: "linear" (K -> N), "norm_linear" (RMSNorm, then K -> N) or "mlp" (RMSNorm, K -> N, SiLU, N -> K)."""

    kind: str
    K: int
    N: int
    what: str

    @property
    def name(self) -> str:
        shape = f"{self.K}->{self.N}->{self.K}" if self.kind == "mlp" else f"{self.K}->{self.N}"
        return f"{self.kind} {shape}"

    def flop(self, M: int) -> float:
        """fwd+bwd: three GEMMs of 2 M K N flop per linear."""
        return 3 * 2.0 * M * self.K * self.N * (2 if self.kind == "mlp" else 1)


LAYERS = (
    Layer("norm_linear", 256, 768, "RMSNorm + QKV projection (d_model 256)"),
    Layer("linear", 256, 256, "attention output projection"),
    Layer("norm_linear", 256, 1024, "RMSNorm + MLP up projection (hidden 1024)"),
    Layer("linear", 1024, 256, "MLP down projection"),
    Layer("mlp", 256, 1024, "the model's pre-norm MLP (rms_norm_mx_mlp, SiLU)"),
    Layer("norm_linear", 1024, 3072, "RMSNorm + linear at d_model 1024"),
    Layer("linear", 3072, 1024, "down projection at hidden 3072"),
    Layer("mlp", 1024, 3072, "pre-norm MLP at d_model 1024, hidden 3072"),
)


def default_tokens() -> list[int]:
    return trainer_token_counts(2) + [32767, 32768]


class Case:
    """The tensors of one layer at M tokens and its fwd+bwd calls: ours on `route`, the public module, the BF16
    peer and the MX reference. Parameters FP32 (the trainer's master weights), activations BF16."""

    def __init__(self, layer: Layer, M: int, route: str, device: str):
        g = torch.Generator(device=device).manual_seed(M + layer.K + 7 * layer.N)
        K, N = layer.K, layer.N
        self.layer, self.M, self.route = layer, M, route

        def param(*shape, scale=1.0):
            return (torch.randn(*shape, device=device, generator=g) * scale).requires_grad_()

        self.x = torch.randn(M, K, device=device, generator=g).bfloat16().requires_grad_()
        self.gw = (torch.rand(K, device=device, generator=g) + 0.5).requires_grad_()
        self.w, self.b = param(N, K, scale=K**-0.5), param(N, scale=0.1)
        self.w2, self.b2 = param(K, N, scale=N**-0.5), param(K, scale=0.1)
        out = K if layer.kind == "mlp" else N
        self.dy = torch.randn(M, out, device=device, generator=g).bfloat16()
        norm = layer.kind != "linear"
        mlp = layer.kind == "mlp"
        self.params = ([self.gw] if norm else []) + [self.w, self.b] + ([self.w2, self.b2] if mlp else [])
        self.params16 = [p.detach().bfloat16().requires_grad_() for p in self.params]

    # -- the calls (each returns Y; `step` adds the backward)

    def ours(self):
        x, L = self.x, self.layer
        if L.kind == "linear":
            return MXLinearFunction.apply(x, self.w, self.b, SCALING, self.route, None)
        if L.kind == "norm_linear":
            return RMSNormMXLinearFunction.apply(x, self.gw, self.w, self.b, EPS, SCALING, self.route)
        return RMSNormMXMLPFunction.apply(x, self.gw, self.w, self.b, self.w2, self.b2, EPS, SCALING, self.route,
                                          "silu")

    def reference(self):
        x, L = self.x, self.layer
        if L.kind == "linear":
            return mx_linear(x, self.w, self.b, backend="reference")
        if L.kind == "norm_linear":
            return rms_norm_mx_linear(x, self.gw, self.w, self.b, EPS, backend="reference")
        return rms_norm_mx_mlp(x, self.gw, self.w, self.b, self.w2, self.b2, EPS, backend="reference")

    def bf16(self):
        x, L, p = self.x, self.layer, self.params16
        if L.kind == "linear":
            return F.linear(x, p[0], p[1])
        h = F.linear(F.rms_norm(x, (L.K,), p[0], EPS), p[1], p[2])
        return h if L.kind == "norm_linear" else F.linear(F.silu(h), p[3], p[4])

    def fp32(self):
        """FP32 math on the same values (the accuracy figures' truth)."""
        x, L, p = self.x.float(), self.layer, self.params
        if L.kind == "linear":
            return F.linear(x, p[0], p[1])
        h = F.linear(F.rms_norm(x, (L.K,), p[0], EPS), p[1], p[2])
        return h if L.kind == "norm_linear" else F.linear(F.silu(h), p[3], p[4])

    def module(self):
        """The public module (`backend="triton"`: the first GPU route the dispatch table gives this arch), with the
        parameters of `ours`; None for the MLP (its op is the model's FeedForward's)."""
        L = self.layer
        if L.kind == "mlp":
            return None
        cls = MXLinear if L.kind == "linear" else RMSNormMXLinear
        m = cls(L.K, L.N, backend="triton").to(self.x.device)
        with torch.no_grad():
            m.weight.copy_(self.w)
            m.bias.copy_(self.b)
            if L.kind == "norm_linear":
                m.norm_weight.copy_(self.gw)
        return m

    def step(self, fn, params):
        y = fn()
        return torch.autograd.grad(y, [self.x, *params], self.dy)

    def accuracy(self) -> dict:
        """SQNR (dB) of Y and the gradients: ours and BF16 against FP32 math, ours against the MX reference."""
        names = ["Y", "dX"] + [f"d{n}" for n in (["norm_weight"] if self.layer.kind != "linear" else [])
                               + ["W", "b"] + (["W2", "b2"] if self.layer.kind == "mlp" else [])]

        def run(fn, params, dy):
            y = fn()
            return [y.detach().float(), *(g.float() for g in torch.autograd.grad(y, [self.x, *params], dy))]

        truth = run(self.fp32, self.params, self.dy.float())
        ours = run(self.ours, self.params, self.dy)
        ref = run(self.reference, self.params, self.dy)
        bf16 = run(self.bf16, self.params16, self.dy)
        out = {}
        for i, name in enumerate(names):
            out[name] = dict(ours_vs_fp32=sqnr_db(ours[i], truth[i]), bf16_vs_fp32=sqnr_db(bf16[i], truth[i]),
                             ours_vs_mx_reference=sqnr_db(ours[i], ref[i]))
        return out


def _fail(bench: Bench, group: str, name: str, e: Exception) -> None:
    msg = f"{type(e).__name__}: {str(e)[:300]}"
    print(f"  [{group}] {name}: FAILED {msg}", flush=True)
    traceback.print_exc(limit=3)
    bench.rows.append(dict(group=group, name=name, error=msg))


def _time(bench: Bench, group: str, name: str, fn, flop: float, peer: bool = False, **info) -> float | None:
    """`bench.time` with the host milliseconds per call (`host_ms_per_call`; `host_bound` when it reaches the
    row's time: the row then measures the host)."""
    try:
        fn()  # compiles, quantizes W
        host_ms = host_us_per_call(fn, calls=20) / 1e3
    except Exception as e:
        _fail(bench, group, name, e)
        return None
    ms = bench.time(group, name, fn, flop=flop, peer=peer, host_ms_per_call=host_ms, **info)
    if ms is not None:
        bench.rows[-1]["host_bound"] = host_ms >= 0.9 * ms
    return ms


def bench_case(bench: Bench, layer: Layer, M: int, route: str, accuracy: dict | None) -> dict:
    """One group: the BF16 peers, then ours; returns the summary row (ms of each, ours' TF/s, vs_bf16)."""
    group = f"{layer.name} M={M}"
    flop = layer.flop(M)
    case = Case(layer, M, route, "cuda")
    peer_name = {"linear": "nn.Linear bf16", "norm_linear": "F.rms_norm + nn.Linear bf16",
                 "mlp": "F.rms_norm + nn.Linear + SiLU + nn.Linear bf16"}[layer.kind]
    bf16_ms = _time(bench, group, peer_name, lambda: case.step(case.bf16, case.params16), flop, peer=True)
    if layer.kind != "linear":
        try:
            compiled = torch.compile(case.bf16, dynamic=False)
            _time(bench, group, peer_name + " (torch.compile)", lambda: case.step(compiled, case.params16), flop,
                  peer=True)
        except Exception as e:
            _fail(bench, group, "compiled bf16 peer", e)
    ours_name = {"linear": "MXLinearFunction", "norm_linear": "RMSNormMXLinearFunction",
                 "mlp": "rms_norm_mx_mlp (RMSNormMXMLPFunction)"}[layer.kind] + f" route={route}"
    ours_ms = _time(bench, group, f"ours {ours_name}", lambda: case.step(case.ours, case.params), flop)
    module = case.module()
    if module is not None:
        params = list(module.parameters())
        _time(bench, group, f"ours {type(module).__name__} module (backend='triton')",
              lambda: torch.autograd.grad(module(case.x), [case.x, *params], case.dy), flop)
    if accuracy is not None:
        try:
            accuracy[group] = case.accuracy()
        except Exception as e:
            _fail(bench, group, "accuracy", e)
    for row in bench.rows:
        if row.get("group") == group and "ms" in row and bf16_ms:
            row["vs_bf16"] = bf16_ms / row["ms"]
    del case, module
    clear_weight_cache()
    torch.cuda.empty_cache()
    return dict(layer=layer.name, what=layer.what, M=M, bf16_ms=bf16_ms, ours_ms=ours_ms,
                ours_tflops=flop / ours_ms / 1e9 if ours_ms else None,
                vs_bf16=bf16_ms / ours_ms if bf16_ms and ours_ms else None)


def main(layers: tuple[Layer, ...], tokens: list[int], route: str) -> None:
    t0 = time.time()
    bench = Bench("bench_linear")
    bench.copy_bandwidth()
    accuracy: dict[str, dict] = {}
    summary: list[dict] = []
    bench.extra.update(tokens=tokens, route=route, accuracy_sqnr_db=accuracy, summary=summary)
    for layer in layers:
        for i, M in enumerate(tokens):
            try:
                summary.append(bench_case(bench, layer, M, route, accuracy if i == 0 else None))
            except Exception as e:  # a failing group is recorded; the others still run
                _fail(bench, f"{layer.name} M={M}", "(group)", e)
                torch.cuda.empty_cache()
    bench.extra["wall_s"] = time.time() - t0
    bench.finish()
    print("\nSQNR (dB): ours vs FP32 | BF16 vs FP32 | ours vs the MX reference")
    for group, rows in accuracy.items():
        print(f"  {group:34s} " + "  ".join(f"{n} {v['ours_vs_fp32']:5.1f}|{v['bf16_vs_fp32']:5.1f}|"
                                             f"{v['ours_vs_mx_reference']:5.1f}" for n, v in rows.items()))
    print(f"\n=== bench_linear, route={route}: fwd+bwd, ours against BF16 (vs_bf16 > 1: ours faster)")
    print(f"{'layer':24s} {'M':>7s} {'bf16 ms':>8s} {'ours ms':>8s} {'ours TF/s':>9s} {'vs_bf16':>7s}  what")
    for r in summary:
        def f(v, fmt):
            return format(v, fmt) if v is not None else "FAILED"
        print(f"{r['layer']:24s} {r['M']:7d} {f(r['bf16_ms'], '8.3f'):>8s} {f(r['ours_ms'], '8.3f'):>8s} "
              f"{f(r['ours_tflops'], '9.1f'):>9s} {f(r['vs_bf16'], '7.2f'):>7s}  {r['what']}")


def dry_run(layers: tuple[Layer, ...], tokens: list[int], route: str) -> None:
    """The plan, and every call of every layer once at M = 33 on this machine (CPU: Triton's interpreter; the
    scaled_mm route emulated from exact values), checked against the MX reference."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"token counts: {tokens}; route: {route}; device for the dry run: {device}")
    for layer in layers:
        print(f"  {layer.name:24s} {layer.what}: " + ", ".join(f"{layer.flop(M) / 1e12:.2f}" for M in tokens)
              + " Tflop per fwd+bwd")
    for kind in dict.fromkeys(L.kind for L in layers):  # each kind of layer once, at K = 64, N = 96
        layer = Layer(kind, 64, 96, kind)
        case = Case(layer, 33, route, device)
        acc = case.accuracy()
        module = case.module()
        if module is not None:
            torch.autograd.grad(module(case.x), [case.x, *module.parameters()], case.dy)
        worst = min(v["ours_vs_mx_reference"] for v in acc.values())
        print(f"  dry run {layer.name} M=33: ours vs the MX reference >= {worst:.1f} dB, ours vs FP32: "
              + ", ".join(f"{n} {v['ours_vs_fp32']:.1f}" for n, v in acc.items()))
        assert worst > 40, acc
    print("dry run: every call ran")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default=None, help="comma-separated token counts M (default: two GPU trainer "
                        "batches' counts, 32767 and 32768)")
    parser.add_argument("--layers", default=None, help="comma-separated indices into LAYERS (default: all): "
                        + "; ".join(f"{i} {L.name}" for i, L in enumerate(LAYERS)))
    parser.add_argument("--route", default="cublas", choices=ROUTES,
                        help="the MX linears' GPU route (scaled_mm needs sm_100)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and run every call once at a tiny "
                        "size on this machine (no GPU needed)")
    args = parser.parse_args()
    try:
        tokens = default_tokens() if args.tokens is None else [int(m) for m in args.tokens.split(",")]
        layers = LAYERS if args.layers is None else tuple(LAYERS[int(i)] for i in args.layers.split(","))
    except (ValueError, IndexError) as e:
        parser.error(f"--tokens / --layers: {e}")
    if min(tokens) < 1:
        parser.error("--tokens: token counts must be >= 1")
    if args.dry_run:
        dry_run(layers, tokens, args.route)
    elif not torch.cuda.is_available():
        sys.exit("bench_linear needs a CUDA device (or --dry-run)")
    else:
        main(layers, tokens, args.route)
