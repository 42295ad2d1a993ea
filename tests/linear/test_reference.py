"""The MXFP8 linear recipe (reference backend) and the modules against explicit computations and FP32 (RMSNorm and
rms_norm_quantize alone: tests/norm/test_reference.py)."""
import pytest
import torch
import torch.nn.functional as F

from gem_lp.mx import dequantize, quantize_reference
from gem_lp.linear import RECIPES, MXLinear, RMSNormMXLinear, mx_linear, rms_norm_mx_linear
from gem_lp.norm import rms_norm, rms_norm_quantize
from gem_lp.accuracy import cosine, sqnr_db

M, K, N = 100, 256, 192  # M = 100 ends the colwise (along M) blocks in a partial block of 4


def _u8(t):
    return t.view(torch.uint8)


def deq_rows(t):
    """Dequantized 1x32 blocks along dim 1; `allow_partial` for blocks along M."""
    return dequantize(quantize_reference(t, axis=1, allow_partial=True))


# ----------------------------------------------------------------------------- mx_linear


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mx_linear_equals_explicit_recipe(dtype):
    x = torch.randn(M, K, dtype=dtype, requires_grad=True)
    w = (torch.randn(N, K) / 16).to(dtype).requires_grad_()
    b = torch.randn(N, dtype=dtype, requires_grad=True)
    dy = torch.randn(M, N).to(dtype)
    y = mx_linear(x, w, b)
    dx, dw, db = torch.autograd.grad(y, (x, w, b), dy)
    y_want = (deq_rows(x) @ deq_rows(w).t() + b.float()).to(dtype)
    dx_want = deq_rows(dy) @ deq_rows(w.t()).t()  # dY along N, W^T [K, N] along N
    dw_want = deq_rows(dy.t()) @ deq_rows(x.t()).t()  # dY^T [N, M] and X^T [K, M] along M
    db_want = dy.float().sum(0)
    assert y.dtype == dx.dtype == dw.dtype == db.dtype == dtype
    torch.testing.assert_close(y, y_want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx, dx_want.to(dtype), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dw, dw_want.to(dtype), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(db, db_want.to(dtype), rtol=1e-6, atol=1e-6)


def test_mx_linear_accuracy_vs_fp32():
    x = torch.randn(M, K, requires_grad=True)
    w = (torch.randn(N, K) / 16).requires_grad_()
    b = torch.randn(N, requires_grad=True)
    dy = torch.randn(M, N)
    got = (mx_linear(x, w, b),) + torch.autograd.grad(mx_linear(x, w, b), (x, w), dy)
    ref = (F.linear(x, w, b),) + torch.autograd.grad(F.linear(x, w, b), (x, w), dy)
    rows = []
    for name, a, r in zip(["Y", "dX", "dW"], got, ref):
        rows.append((name, cosine(a, r), sqnr_db(a, r)))
    print("\n" + "\n".join(f"mx_linear {n}: cos {c:.5f}  {s:.1f} dB" for n, c, s in rows))
    assert all(s >= 25 and c >= 0.99 for _, c, s in rows), rows


def test_mx_linear_keeps_leading_dims_and_no_bias():
    x = torch.randn(2, 3, 64, requires_grad=True)
    w = torch.randn(32, 64, requires_grad=True)
    y = mx_linear(x, w)
    assert y.shape == (2, 3, 32)
    y.sum().backward()
    assert x.grad.shape == x.shape and w.grad.shape == w.shape


def _saved_activation_bytes(module, x):
    """Bytes autograd saves in the module's forward, parameters excluded (they are held anyway)."""
    params = {p.data_ptr() for p in module.parameters()}
    total = 0

    def pack(t):
        nonlocal total
        if t.data_ptr() not in params:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x).sum()
    return total


def test_mx_linear_saves_half_the_activation_bytes_of_bf16():
    x = torch.randn(M, K, dtype=torch.bfloat16, requires_grad=True)
    sizes = {}
    for recipe in ("bf16", "mxfp8"):
        torch.manual_seed(0)
        layer = MXLinear(K, N, recipe=recipe).to(torch.bfloat16)
        sizes[recipe] = _saved_activation_bytes(layer, x)
    print(f"\nMXLinear saved activation bytes, M={M} K={K}: bf16 {sizes['bf16']}, mxfp8 {sizes['mxfp8']} "
          f"({sizes['mxfp8'] / sizes['bf16']:.3f}x)")
    assert sizes["bf16"] == M * K * 2
    assert sizes["mxfp8"] == M * K + K * 4  # payload of X^T [K, M] + E8M0 scales [K, ceil(M/32)]
    assert sizes["mxfp8"] < 0.6 * sizes["bf16"]


# ----------------------------------------------------------------------------- RMSNormMXLinear


def test_rms_norm_mx_linear_backward_equals_explicit_recipe():
    x = (torch.randn(M, K) * 2).requires_grad_()
    g = (torch.rand(K) + 0.5).requires_grad_()
    w = (torch.randn(N, K) / 16).requires_grad_()
    b = torch.randn(N, requires_grad=True)
    dy = torch.randn(M, N)
    y = rms_norm_mx_linear(x, g, w, b, 1e-6)
    dx, dg, dw, db = torch.autograd.grad(y, (x, g, w, b), dy)
    q = rms_norm_quantize(x.detach(), g.detach(), 1e-6)
    torch.testing.assert_close(y, dequantize(q.rowwise) @ deq_rows(w).t() + b, rtol=1e-6, atol=1e-6)
    dyn = deq_rows(dy) @ deq_rows(w.t()).t()
    torch.testing.assert_close(dw, deq_rows(dy.t()) @ dequantize(q.colwise).t(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(db, dy.sum(0), rtol=1e-6, atol=1e-6)
    # RMSNorm backward in FP32 from dYn: autograd of the plain FP32 normalization
    xx, gg = x.detach().clone().requires_grad_(), g.detach().clone().requires_grad_()
    yn = xx * torch.rsqrt(xx.square().mean(-1, keepdim=True) + 1e-6) * gg
    dx_want, dg_want = torch.autograd.grad(yn, (xx, gg), dyn)
    torch.testing.assert_close(dx, dx_want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dg, dg_want, rtol=1e-4, atol=1e-4)


def test_rms_norm_mx_linear_rounds_dyn_to_the_input_dtype():
    """BF16 x: the norm backward starts from dYn rounded once to BF16 (what BF16 autograd hands a norm)."""
    x = (torch.randn(M, K) * 2).to(torch.bfloat16).requires_grad_()
    g = (torch.rand(K) + 0.5).requires_grad_()
    w = (torch.randn(N, K) / 16).requires_grad_()
    dy = torch.randn(M, N, dtype=torch.bfloat16)
    y = rms_norm_mx_linear(x, g, w, None, 1e-6)
    dx, dg = torch.autograd.grad(y, (x, g), dy)
    dyn = (deq_rows(dy.float()) @ deq_rows(w.t()).t()).to(torch.bfloat16).float()
    xx, gg = x.detach().float().requires_grad_(), g.detach().clone().requires_grad_()
    yn = xx * torch.rsqrt(xx.square().mean(-1, keepdim=True) + 1e-6) * gg
    dx_want, dg_want = torch.autograd.grad(yn, (xx, gg), dyn)
    assert dx.dtype == torch.bfloat16
    torch.testing.assert_close(dx.float(), dx_want.to(torch.bfloat16).float(), rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(dg, dg_want, rtol=1e-4, atol=1e-4)


def test_rms_norm_mx_linear_accuracy_vs_fp32():
    x = (torch.randn(M, K) * 2).requires_grad_()
    layer = RMSNormMXLinear(K, N)
    ref_layer = RMSNormMXLinear(K, N, recipe="fp32")
    ref_layer.load_state_dict(layer.state_dict())
    with torch.no_grad():
        layer.norm_weight.uniform_(0.5, 1.5)
        ref_layer.norm_weight.copy_(layer.norm_weight)
    dy = torch.randn(M, N)
    got = [layer(x)]
    got += torch.autograd.grad(layer(x), [x] + list(layer.parameters()), dy)
    ref = [ref_layer(x)]
    ref += torch.autograd.grad(ref_layer(x), [x] + list(ref_layer.parameters()), dy)
    names = ["Y", "dX"] + [f"d{n}" for n, _ in layer.named_parameters()]
    rows = [(n, cosine(a, r), sqnr_db(a, r)) for n, a, r in zip(names, got, ref)]
    print("\n" + "\n".join(f"RMSNormMXLinear {n}: cos {c:.5f}  {s:.1f} dB" for n, c, s in rows))
    assert all(s >= 25 and c >= 0.99 for _, c, s in rows), rows


# ----------------------------------------------------------------------------- modules


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cls", [MXLinear, RMSNormMXLinear])
def test_modules_forward_backward_all_recipes(cls, dtype, recipe):
    torch.manual_seed(0)
    layer = cls(64, 96, recipe=recipe)
    ref = cls(64, 96, recipe="fp32")
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(2, 7, 64, dtype=dtype, requires_grad=True)
    y = layer(x)
    assert y.shape == (2, 7, 96) and y.dtype == dtype
    dy = torch.randn(y.shape, dtype=dtype)
    y.backward(dy)
    assert x.grad.dtype == dtype and x.grad.shape == x.shape
    for p in layer.parameters():
        assert p.grad is not None and p.grad.dtype == p.dtype and torch.isfinite(p.grad).all()
    xr = x.detach().requires_grad_()
    ref(xr).backward(dy)
    floor = {"fp32": 60, "bf16": 30, "mxfp8": 22}[recipe] if dtype == torch.float32 else 22
    assert sqnr_db(y, ref(x.detach())) > floor
    assert sqnr_db(x.grad, xr.grad) > floor
    for p, pr in zip(layer.parameters(), ref.parameters()):
        assert sqnr_db(p.grad, pr.grad) > floor


@pytest.mark.parametrize("recipe", RECIPES)
def test_mx_linear_module_input_activation_is_the_activation_then_the_layer(recipe):
    """`MXLinear(input_activation="silu")` computes the layer of `F.silu(x)` in every recipe (same outputs and
    gradients as the composition); an unknown activation is refused and the repr names it."""
    torch.manual_seed(0)
    layer = MXLinear(64, 32, recipe=recipe, input_activation="silu")
    plain = MXLinear(64, 32, recipe=recipe)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(9, 64, dtype=torch.bfloat16)
    dy = torch.randn(9, 32, dtype=torch.bfloat16)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = layer(xa), plain(torch.nn.functional.silu(xb))
    ya.backward(dy)
    yb.backward(dy)
    assert torch.equal(ya, yb) and torch.equal(xa.grad, xb.grad)
    for pa, pb in zip(layer.parameters(), plain.parameters()):
        assert torch.equal(pa.grad, pb.grad)
    assert "input_activation='silu'" in repr(layer)
    with pytest.raises(ValueError, match="input_activation must be None or one of"):
        MXLinear(64, 32, recipe=recipe, input_activation="gelu")


def test_module_backend_is_passed_through():
    layer = MXLinear(32, 32, backend="reference")
    assert layer(torch.randn(3, 32)).shape == (3, 32)
    with pytest.raises(ValueError, match="backend must be one of"):
        MXLinear(32, 32, backend="cuda")


@pytest.mark.parametrize("recipe", ["bf16", "fp32"])
def test_norm_module_takes_every_backend_its_recipe_has(recipe):
    """The BF16 / FP32 recipes' norm (`rms_norm(precision="bf16")`) has no Triton kernel: `backend="triton"` (a
    model's backend, passed to every op) runs torch's norm there, as "reference" and "auto" do on the CPU."""
    torch.manual_seed(0)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    outs = []
    for backend in ("reference", "auto", "triton"):
        torch.manual_seed(1)
        layer = RMSNormMXLinear(64, 32, recipe=recipe, backend=backend)
        outs.append(layer(x))
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


# ----------------------------------------------------------------------------- errors


def test_errors():
    x, w = torch.randn(8, 64), torch.randn(32, 64)
    with pytest.raises(ValueError, match="multiples of 32"):
        mx_linear(torch.randn(8, 48), torch.randn(32, 48))
    with pytest.raises(ValueError, match="multiples of 32"):
        mx_linear(x, torch.randn(40, 64))
    with pytest.raises(ValueError, match="x's last dim must equal weight's K"):
        mx_linear(torch.randn(8, 32), w)
    with pytest.raises(ValueError, match=r"bias must be \[N=32\]"):
        mx_linear(x, w, torch.randn(31))
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        mx_linear(x.double(), w)
    with pytest.raises(ValueError, match="must be on x's device"):
        mx_linear(x, w.to("meta"))
    with pytest.raises(ValueError, match="scaling must be one of"):
        mx_linear(x, w, scaling="round")
    with pytest.raises(ValueError, match=r"weight must be \[K=64\]"):
        rms_norm(x, torch.randn(32))
    with pytest.raises(ValueError, match="eps must be"):
        rms_norm(x, torch.randn(64), -1.0)
    with pytest.raises(ValueError, match="multiple of 32"):
        rms_norm_quantize(torch.randn(8, 40), torch.randn(40))
    with pytest.raises(ValueError, match=r"norm_weight must be \[K=64\]"):
        rms_norm_mx_linear(x, torch.randn(3), w)
    with pytest.raises(ValueError, match="recipe must be one of"):
        MXLinear(64, 32, recipe="fp8")
    with pytest.raises(ValueError, match="multiples of 32"):
        RMSNormMXLinear(64, 33)
    RMSNormMXLinear(64, 33, recipe="bf16")  # any size outside mxfp8


def test_mx_recipe_ignores_autocast():
    x, w = torch.randn(16, 64, requires_grad=True), torch.randn(32, 64, requires_grad=True)
    y = mx_linear(x, w)
    grads = torch.autograd.grad(y.sum(), (x, w))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y2 = mx_linear(x, w)
        grads2 = torch.autograd.grad(y2.sum(), (x, w))
    assert y2.dtype == torch.float32 and torch.equal(y, y2)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads2))


@pytest.mark.parametrize("cls", [MXLinear, RMSNormMXLinear])
@pytest.mark.parametrize("rows", [64, 96])
def test_rotated_output_rows_are_the_outputs_times_the_hadamard_matrix(cls, rows):
    from gem_lp.rotation import hadamard_matrix

    torch.manual_seed(0)
    rotated = cls(64, 96, recipe="fp32", rotated_rows=rows, rotation_block=32)
    plain = cls(64, 96, recipe="fp32")
    plain.load_state_dict(rotated.state_dict())
    x = torch.randn(5, 64)
    y, y0 = rotated(x), plain(x)
    expected = torch.cat([(y0[:, :rows].reshape(5, -1, 32) @ hadamard_matrix(32)).reshape(5, rows), y0[:, rows:]], 1)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    y.square().sum().backward()
    assert rotated.weight.grad is not None and rotated.bias.grad is not None
    assert "rotated_rows=" in repr(rotated) and "rotated_rows" not in repr(plain)


@pytest.mark.parametrize("rows,block", [(48, 32), (96, 24), (128, 32)])
def test_rotated_output_rows_errors(rows, block):
    with pytest.raises(ValueError, match="rotated_rows must be"):
        MXLinear(64, 96, recipe="fp32", rotated_rows=rows, rotation_block=block)
