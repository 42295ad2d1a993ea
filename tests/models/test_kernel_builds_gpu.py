"""No kernel is built after the first training step: the GPU kernels (Triton and CuTe DSL) specialize on nothing
that changes from one jagged batch to the next (token counts, history lengths, the longest sequence)."""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from gem_lp.data import PlantedTeacher, SyntheticDataConfig, make_batch
from gem_lp.models import GemModelConfig, GemRanker
from gem_lp.train.logging_utils import KernelBuilds

# the GPU config's layer shapes (head dim 128, widths multiples of 128), one block to keep the test short
MODEL = dict(embedding_dim=128, d_model=256, num_heads=2, head_dim=128, num_blocks=1, mlp_hidden=512,
             dense_hidden=128, head_hidden=256)
STEPS = 100


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
# A sequence count above 256 gives the attention schedulers a cumulative tile table (another build of each kernel):
# a trainer's batch size is fixed, so each side of it is taken once, at the first step.
@pytest.mark.parametrize("batch_size", [40, 300])
def test_no_kernel_builds_after_the_first_step(precision, batch_size):
    data = SyntheticDataConfig(batch_size=batch_size, num_items=5000, history_min=0, history_max=600,
                               history_sigma=1.0)
    teacher = PlantedTeacher(data)
    torch.manual_seed(0)
    model = GemRanker(GemModelConfig(precision=precision, **MODEL), data.feature_spec()).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rng = torch.Generator().manual_seed(1)
    tokens = set()

    def step(i):
        # a history mean drawn log-uniformly from [1, 400] per batch: token counts and maximum lengths vary widely
        mean = math.exp(torch.rand((), generator=rng).item() * math.log(400.0))
        batch = make_batch(dataclasses.replace(data, history_mean=mean), teacher, 0, "train", i).to("cuda")
        tokens.add(int(batch.sequence_features.lengths().sum()))
        loss = F.binary_cross_entropy_with_logits(model(batch), batch.labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    step(0)
    torch.cuda.synchronize()
    with KernelBuilds() as builds:
        for i in range(1, STEPS):
            loss = step(i)
        torch.cuda.synchronize()
    assert torch.isfinite(loss)
    assert len(tokens) > STEPS // 2  # the batches really differ in size
    assert builds.count == 0, (f"{builds.count} kernel builds after the first step ({precision}, B={batch_size}):\n"
                               + "\n".join(builds.builds()))
