"""The Blackwell plan end to end on the CPU: under `dispatch.emulate("sm_100")` every op of the MXFP8 ranker takes
its sm_100 implementation — the MX linears on the block-scaled GEMM route (`scaled_mm`, its product from the exact
values), the casts as the Triton kernels (in the interpreter), attention through `gem_lp.jagged`'s zero-gather
producer into the CPU models of the block-scaled kernels — and the loss and every gradient match the reference recipe;
the trainer runs steps on that plan (producer, jagged layout, kernels, backward, optimizer) and records it."""
import json
import math

import torch
import torch.nn.functional as F

from gem_lp.accuracy import sqnr_db
from gem_lp.data import PlantedTeacher, SparseFeatureSpec, SyntheticDataConfig, make_batch
from gem_lp.models import GemModelConfig, GemRanker
from gem_lp.runtime import dispatch
from gem_lp.train import Trainer
from train_helpers import TINY, compose_config

DATA = SyntheticDataConfig(batch_size=8, num_items=100, history_mean=20.0, history_min=0, history_max=140,
                           sparse_features=(SparseFeatureSpec("a", 40, 1),))
SMALL = dict(embedding_dim=32, d_model=64, num_heads=2, head_dim=64, num_blocks=1, mlp_hidden=64, dense_hidden=32,
             head_hidden=64)


def _loss_and_grads(model, batch):
    loss = F.binary_cross_entropy_with_logits(model(batch), batch.labels)
    names, params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
    return loss.detach(), dict(zip(names, torch.autograd.grad(loss, params, allow_unused=True)))


def test_the_sm100_plan_matches_the_reference_recipe():
    batch = make_batch(DATA, PlantedTeacher(DATA), 0, "train", 0)
    torch.manual_seed(0)
    ref_model = GemRanker(GemModelConfig(precision="mxfp8", backend="reference", **SMALL), DATA.feature_spec())
    ref_loss, ref_grads = _loss_and_grads(ref_model, batch)
    with dispatch.emulate("sm_100"):
        torch.manual_seed(0)
        model = GemRanker(GemModelConfig(precision="mxfp8", **SMALL), DATA.feature_spec())
        plan = {c["op"]: c["impl"] for c in dispatch.kernel_plan(model.kernel_ops(), torch.device("cpu"))}
        assert plan == {"linear": "scaled_mm", "linear_weight_grad": "reference", "rms_norm_quantize": "triton",
                        "rms_norm_backward": "triton", "attention": "cute_sm100"}
        loss, grads = _loss_and_grads(model, batch)
    # the recipe's rounding: the same MX values everywhere, FP32 sums in other orders (a last-bit difference can
    # move a value across an E4M3 rounding boundary of a later layer)
    assert abs(loss.item() - ref_loss.item()) < 1e-3 * ref_loss.item()
    worst = min(sqnr_db(grads[n], ref_grads[n]) for n in ref_grads if ref_grads[n] is not None and ref_grads[n].any())
    assert worst > 20, worst


def test_trainer_steps_on_the_sm100_plan(tmp_path):
    cfg = compose_config(*TINY, "model=gem_mxfp8", "trainer.max_steps=2", "trainer.eval_every=2", "trainer.eval_batches=1",
                      "trainer.checkpoint_every=2", "data.batch_size=8", "model.num_blocks=1", "model.head_dim=64")
    with dispatch.emulate("sm_100"):
        metrics = Trainer(cfg, tmp_path).fit()
    on_disk = json.loads((tmp_path / "metrics.json").read_text())
    assert {c["op"]: (c["impl"], c["arch"]) for c in on_disk["kernel_plan"]} == {
        "linear": ("scaled_mm", "sm_100"), "linear_weight_grad": ("reference", "sm_100"),
        "rms_norm_quantize": ("triton", "sm_100"),
        "rms_norm_backward": ("triton", "sm_100"), "attention": ("cute_sm100", "sm_100")}
    assert metrics["steps"] == 2 and all(math.isfinite(x) for x in metrics["train_loss_history"])
    assert math.isfinite(metrics["eval_loss"])
