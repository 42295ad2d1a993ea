"""Byte-for-byte comparison of payloads and scales, shared by the kernel tests."""
import torch


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def assert_same_bytes(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Every byte of `actual` equals `expected`'s (any device, any 1-byte or wider dtype viewed as bytes)."""
    a, e = u8(actual).cpu(), u8(expected).cpu()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    bad = (a != e).nonzero()
    assert bad.numel() == 0, (f"{what}: {bad.shape[0]} of {a.numel()} bytes differ, first at "
                              f"{tuple(bad[0].tolist())}: {a[tuple(bad[0])].item()} vs {e[tuple(bad[0])].item()}")
