"""Every launch of the benchmark's tuning space (`CANDIDATE_LAUNCHES`), with its own orientation set, byte for
byte against the reference: in the interpreter on CPU (where the thread layout is moot but the strip axes,
the chunk size and the reductions over them are what run), with the hardware cast on a GPU."""
import pytest
import torch

from gem_lp.jagged import JaggedLayout, quantize_jagged_reference
from gem_lp.jagged.tensor import scale_sizes
from gem_lp.jagged.triton_kernel import CANDIDATE_LAUNCHES, LAUNCH_SETS, launch
from gem_lp.mx.formats import PAYLOAD_DTYPE

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

# a short mix: a lone token, a partial 32-token block, a sequence crossing a 128-row tile, an empty one;
# the fixture's NaN/Inf/huge/subnormal values wrap onto these sequences
LENGTHS = (1, 33, 0, 129, 70)
SCALE_NAMES = {"hdim": ("hdim",), "seq": ("seq",), "square": ("square_hdim", "square_seq")}


def _cases():
    """(set name, rows, thread_rows, row_blocks_in_thread): the interpreter runs each distinct strip shape
    once per set (warps and register limits do not change what it computes)."""
    seen = {}
    for set_name, launches in CANDIDATE_LAUNCHES.items():
        for rows, thread_rows, row_blocks, *_ in launches:
            seen.setdefault((set_name, rows, thread_rows, row_blocks), None)
    return list(seen)


def _full_cases():
    return sorted({(s, *c) for s, launches in CANDIDATE_LAUNCHES.items() for c in launches})


CASES = _cases() if not torch.cuda.is_available() else _full_cases()


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_candidate_launch_every_byte(mixed_batch, case):
    set_name, rows, thread_rows, row_blocks, *rest = case
    options = dict(rows=rows, thread_rows=thread_rows, row_blocks_in_thread=row_blocks)
    if rest:
        options.update(num_warps=rest[0])
    orientations = LAUNCH_SETS[set_name]
    values, offsets = mixed_batch(1, 128, torch.bfloat16, lengths=LENGTHS)
    layout = JaggedLayout.from_offsets(offsets, values)
    t, h, d = values.shape
    hdim_bytes, seq_bytes = scale_sizes(layout.padded_total, d)
    dev = values.device
    payloads = {o: torch.full((t, h, d), 0xA5, dtype=torch.uint8, device=dev).view(PAYLOAD_DTYPE)
                for o in orientations}
    scales = {n: torch.full((h, hdim_bytes if n.endswith("hdim") else seq_bytes), 0xA5, dtype=torch.uint8,
                            device=dev) for o in orientations for n in SCALE_NAMES[o]}
    launch(values, layout.offsets, layout.scale_offsets, layout.tile_seq, layout.padded_total, payloads, scales,
           True, **options)
    ref = quantize_jagged_reference(values, layout, orientations, "rceil")
    for o in orientations:
        assert torch.equal(payloads[o].view(torch.uint8), ref.payload(o).view(torch.uint8)), f"payload_{o}"
        for n in SCALE_NAMES[o]:
            assert torch.equal(scales[n], getattr(ref, f"scale_{n}")), f"scale_{n}"
