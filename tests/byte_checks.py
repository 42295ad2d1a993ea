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


def assert_same_values(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Same floating-point values bit for bit, NaN where the other has NaN (a NaN's payload bits are not a value: the
    GPU writes its canonical NaN, the CPU keeps the operand's)."""
    a, e = actual.cpu(), expected.cpu()
    assert a.shape == e.shape and a.dtype == e.dtype, f"{what}: {a.dtype}{tuple(a.shape)} != {e.dtype}{tuple(e.shape)}"
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    bad = ((u8(a).view(a.numel(), -1) != u8(e).view(e.numel(), -1)).any(1).view(a.shape) & ~(nan_a & nan_e)) | (
        nan_a != nan_e)
    where = bad.nonzero()
    assert where.numel() == 0, (f"{what}: {where.shape[0]} of {a.numel()} values differ, first at "
                                f"{tuple(where[0].tolist())}: {a[tuple(where[0])].item()} vs {e[tuple(where[0])].item()}")
