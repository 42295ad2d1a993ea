"""One jagged quantize launch checked byte for byte against the per-sequence reference (shared by the launch
tests): outputs start filled with 0xA5, so a byte the kernel never writes fails too."""
import torch

from gem_lp.jagged import JaggedLayout, quantize_jagged_reference
from gem_lp.jagged.tensor import scale_sizes
from gem_lp.jagged.kernels.triton_quantize import launch
from gem_lp.mx.formats import PAYLOAD_DTYPE

SCALE_NAMES = {"hdim": ("hdim",), "seq": ("seq",), "square": ("square_hdim", "square_seq")}


def check_launch(values: torch.Tensor, offsets: torch.Tensor, orientations, **options) -> JaggedLayout:
    """Launch with `options` (rceil) and assert every payload and scale byte equals the reference's."""
    layout = JaggedLayout.from_offsets(offsets, values)
    t, h, d = values.shape
    hdim_bytes, seq_bytes = scale_sizes(layout.padded_total, d)
    dev = values.device
    payloads = {o: torch.full((t, h, d), 0xA5, dtype=torch.uint8, device=dev).view(PAYLOAD_DTYPE)
                for o in orientations}
    scales = {n: torch.full((h, hdim_bytes if n.endswith("hdim") else seq_bytes), 0xA5, dtype=torch.uint8,
                            device=dev) for o in orientations for n in SCALE_NAMES[o]}
    launch(values, layout.offsets, layout.scale_offsets, layout.tile_seq, layout.padded_total, payloads, scales,
           True, tile_tokens=layout.tile_tokens, **options)
    ref = quantize_jagged_reference(values, layout, orientations, "rceil")
    for o in orientations:
        assert torch.equal(payloads[o].view(torch.uint8), ref.payload(o).view(torch.uint8)), f"payload_{o}"
        for n in SCALE_NAMES[o]:
            assert torch.equal(scales[n], getattr(ref, f"scale_{n}")), f"scale_{n}"
    return layout
