"""The persistent walk (`programs_per_sm > 0`): every launch of `PERSISTENT_LAUNCHES` with its own orientation
set, and the walk with every orientation set and several feature chunks, byte for byte against the reference
(in the interpreter on CPU, where one SM is assumed so that the grid has programs_per_sm programs; with the
hardware cast on a GPU)."""
import pytest
import torch

from gem_lp.jagged import JaggedLayout
from gem_lp.jagged.tensor import scale_sizes
from gem_lp.jagged.kernels.triton_quantize import LAUNCH_SETS, launch, launch_args
from benchmarks.launch_candidates import PERSISTENT_LAUNCHES
from gem_lp.mx.formats import PAYLOAD_DTYPE
from jagged_launch_check import check_launch

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

# zero-length sequences, a lone token (its chunk then 3 chunks of padding rows only), partial 32-token blocks
# on both sides of a block edge, a sequence ending one short of its tile, one crossing into a second tile
LENGTHS = (31, 0, 1, 127, 33, 0, 129)
CASES = sorted({(s, *c) for s, launches in PERSISTENT_LAUNCHES.items() for c in launches})
if not torch.cuda.is_available():  # warps and register limits do not change what the interpreter runs
    CASES = sorted({(s, rows, t, b, 0, 0, per_sm) for s, rows, t, b, _, _, per_sm in CASES})


def _run(mixed_batch, orientations, heads, dim, lengths=LENGTHS, **options):
    """Launch into outputs filled with 0xA5 (every byte must be written) and compare with the reference."""
    values, offsets = mixed_batch(heads, dim, torch.bfloat16, lengths=lengths)
    return check_launch(values, offsets, orientations, **options)


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_persistent_launch_every_byte(mixed_batch, case):
    set_name, rows, thread_rows, row_blocks, num_warps, max_registers, per_sm = case
    options = dict(rows=rows, thread_rows=thread_rows, row_blocks_in_thread=row_blocks, programs_per_sm=per_sm)
    if torch.cuda.is_available():
        options.update(num_warps=num_warps, max_registers=max_registers)
    _run(mixed_batch, LAUNCH_SETS[set_name], 2, 128, **options)


@pytest.mark.parametrize("orientations", [("seq",), ("square",), ("hdim", "seq", "square")])
def test_persistent_walk_every_set_and_feature_chunk(mixed_batch, orientations):
    """D = 96: three 32-feature chunks (the first from the prefetch, the others loaded in place), padding
    columns of the hdim form and padding rows of the seq form; 3 programs walk 3 heads (items of one chunk
    land on different programs)."""
    _run(mixed_batch, orientations, 3, 96, rows=32, thread_rows=8, programs_per_sm=3)


def test_more_programs_than_items(mixed_batch):
    """A grid never exceeds the work items: each program then takes one (its prefetch is all masked)."""
    layout = _run(mixed_batch, ("hdim", "seq"), 1, 64, lengths=(1, 0, 40), rows=64, thread_rows=4,
                  programs_per_sm=64)
    assert layout.padded_total // 64 < 64


def test_empty_batches(mixed_batch):
    """T = 0 (only zero-length sequences, or none): nothing to launch, nothing written."""
    for lengths in ((0, 0, 0), ()):
        values, offsets = mixed_batch(2, 64, torch.bfloat16, lengths=lengths)
        layout = JaggedLayout.from_offsets(offsets, values)
        assert layout.padded_total == 0
        payloads = {"hdim": torch.empty(0, 2, 64, dtype=PAYLOAD_DTYPE, device=values.device)}
        scales = {"hdim": torch.empty(2, 0, dtype=torch.uint8, device=values.device)}
        launch(values, layout.offsets, layout.scale_offsets, layout.tile_seq, 0, payloads, scales, True,
               programs_per_sm=4)


def test_persistent_grid_and_option_check(mixed_batch):
    """programs_per_sm x SMs programs (at most one per chunk and head), PERSISTENT only when asked; a
    negative or non-int count is rejected."""
    values, offsets = mixed_batch(2, 64, lengths=(300,))
    layout = JaggedLayout.from_offsets(offsets, values)
    payloads = {"hdim": torch.empty(values.shape, dtype=PAYLOAD_DTYPE, device=values.device)}
    scales = {"hdim": torch.empty(2, scale_sizes(layout.padded_total, 64)[0], dtype=torch.uint8,
                                  device=values.device)}

    def plan(**options):
        return launch_args(values, layout.offsets, layout.scale_offsets, layout.tile_seq, layout.padded_total,
                           payloads, scales, True, rows=32, **options)

    n_items = layout.padded_total // 32 * 2
    grid, _, kwargs = plan()
    assert grid == (n_items,) and not kwargs["PERSISTENT"]
    sms = torch.cuda.get_device_properties(values.device).multi_processor_count if values.is_cuda else 1
    grid, _, kwargs = plan(programs_per_sm=3)
    assert grid == (min(n_items, 3 * sms),) and kwargs["PERSISTENT"]
    for bad in (-1, 2.0):
        with pytest.raises(ValueError, match="programs_per_sm must be an int >= 0"):
            plan(programs_per_sm=bad)
