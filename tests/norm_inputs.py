"""Inputs of the norm and cast tests: rows across a wide range of magnitudes with outliers, and norm weights."""
import torch


def generic_input(M, K, dtype, seed, device):
    """randn rows at magnitudes 2^-20..2^20 (fp16: 2^-6..2^6) with a few large outliers."""
    g = torch.Generator().manual_seed(seed)
    span = 6 if dtype == torch.float16 else 20
    x = torch.randn(M, K, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-span, span + 1, (M, 1), generator=g).double())
    idx = torch.randint(0, M * K, (max(1, M * K // 200),), generator=g)
    x.view(-1)[idx] *= 50.0
    return x.to(dtype).to(device)


def norm_weight(K, dtype, seed, device):
    """Weights of magnitude 0.5..1.5, a tenth of them negative."""
    g = torch.Generator().manual_seed(seed + 1)
    w = (torch.rand(K, generator=g) + 0.5) * torch.where(torch.rand(K, generator=g) < 0.1, -1.0, 1.0)
    return w.to(dtype).to(device)
