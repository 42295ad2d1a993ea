"""Trainer: smoke run through the Hydra config, exact resume, NaN/Inf guard (naming the tensor), atomic checkpoints."""
import json
import math
import os

import pytest
import torch

from gem_lp.data import DataError
from gem_lp.train import ConfigError, NonFiniteError, Trainer, load_checkpoint, save_atomic

METRIC_KEYS = {"precision", "steps", "train_loss", "eval_loss", "eval_auc", "eval_ne", "samples_per_s",
               "samples_per_s_median_step", "kernel_builds_after_warmup", "peak_mem_bytes", "device", "teacher_auc",
               "eval_history", "train_loss_history", "train_loss_window", "resumes"}


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_smoke_20_steps(tiny_config, tmp_path, precision):
    cfg = tiny_config(f"model=gem_{precision}", "trainer.tensorboard=true")
    metrics = Trainer(cfg, tmp_path).fit()
    on_disk = json.loads((tmp_path / "metrics.json").read_text())
    assert on_disk == json.loads(json.dumps(metrics))
    assert METRIC_KEYS <= set(on_disk)
    assert on_disk["precision"] == precision and on_disk["steps"] == 20 and on_disk["device"] == "cpu"
    assert len(on_disk["train_loss_history"]) == 20
    assert [p["step"] for p in on_disk["eval_history"]] == [10, 20]
    for key in ("train_loss", "eval_loss", "eval_auc", "eval_ne", "teacher_auc", "samples_per_s",
                "samples_per_s_median_step"):
        assert math.isfinite(on_disk[key]) and on_disk[key] > 0, key
    assert on_disk["kernel_builds_after_warmup"] == 0  # the CPU path runs no compiled Triton kernel
    assert on_disk["sequence_graphs"] == on_disk["sequence_graph_eager_batches"] == 0  # graphs need a GPU
    assert on_disk["peak_mem_bytes"] > 0
    assert 0.5 < on_disk["teacher_auc"] <= 1.0
    assert (tmp_path / "checkpoint.pt").is_file()
    assert any((tmp_path / "tensorboard").iterdir())
    # training moves the loss: the last steps beat the first ones
    losses = on_disk["train_loss_history"]
    assert sum(losses[-5:]) < sum(losses[:5])


@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_resume_continues_exactly(tiny_config, tmp_path, precision):
    common = [f"model=gem_{precision}", "trainer.max_steps=8", "trainer.eval_every=4", "trainer.checkpoint_every=4"]
    straight = Trainer(tiny_config(*common), tmp_path / "straight").fit()

    first = Trainer(tiny_config(*common, "trainer.stop_after=4"), tmp_path / "resumed").fit()
    assert first["steps"] == 4
    resumed = Trainer(tiny_config(*common, "resume=true"), tmp_path / "resumed").fit()

    assert resumed["steps"] == 8
    assert resumed["train_loss_history"] == straight["train_loss_history"]  # bit-identical trajectory
    assert resumed["eval_history"] == straight["eval_history"]
    a = load_checkpoint(tmp_path / "straight" / "checkpoint.pt")
    b = load_checkpoint(tmp_path / "resumed" / "checkpoint.pt")
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert a["dense_scheduler"]["last_epoch"] == b["dense_scheduler"]["last_epoch"] == 8


def test_resume_errors(tiny_config, tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        Trainer(tiny_config("resume=true"), tmp_path / "empty")
    Trainer(tiny_config("trainer.max_steps=4", "trainer.stop_after=2"), tmp_path / "run").fit()
    with pytest.raises(ConfigError, match=r"model config differs from this run's \(model.num_blocks: 1 in the "
                                          r"checkpoint, 2 now\)"):
        Trainer(tiny_config("trainer.max_steps=4", "resume=true", "model.num_blocks=2"), tmp_path / "run")
    with pytest.raises(ConfigError, match="checkpoint seed 0 != seed 3"):
        Trainer(tiny_config("trainer.max_steps=4", "resume=true", "seed=3"), tmp_path / "run")


@pytest.mark.parametrize("pipelined", [False, True], ids=["synchronous", "pipelined"])
def test_nan_loss_stops_naming_the_step(tiny_config, tmp_path, pipelined):
    """Also when the check is read one step late (pipelined: step 4's forward and backward ran, not its update)."""
    trainer = Trainer(tiny_config(), tmp_path)
    trainer.pipelined = pipelined
    calls = {"n": 0}

    def poison(module, args, output):  # the third training forward produces NaN
        calls["n"] += 1
        return output * math.nan if calls["n"] == 3 else output

    trainer.model.dense_input.register_forward_hook(poison)
    after_two = {}

    def remember(module, args):  # the weights as the third step starts
        if calls["n"] == 2:
            after_two.update({k: v.clone() for k, v in trainer.model.state_dict().items()})

    trainer.model.dense_input.register_forward_pre_hook(remember)
    with pytest.raises(NonFiniteError, match=r"step 3: training loss is nan"):
        trainer.fit()
    assert trainer.step == 2 and len(trainer.losses) == 2 and calls["n"] == (4 if pipelined else 3)
    for k, v in trainer.model.state_dict().items():  # the NaN loss's backward ran; no update followed it
        assert torch.equal(v, after_two[k]), k


def test_nan_gradient_stops_before_the_update(tiny_config, tmp_path):
    trainer = Trainer(tiny_config(), tmp_path)
    weight = trainer.model.logit.weight
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    weight.register_hook(lambda g: g * math.inf)
    with pytest.raises(NonFiniteError, match=r"step 1: non-finite gradients in \['logit.weight'\]"):
        trainer.fit()
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_gradient_norm_overflow_is_named_as_such(tiny_config, tmp_path):
    """Finite gradient values whose L2 norm overflows float32: said as such, naming the tensor, before the update
    (gradient clipping would otherwise scale every dense gradient by 0/inf)."""
    trainer = Trainer(tiny_config(), tmp_path)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.model.logit.weight.register_hook(lambda g: torch.full_like(g, 3e19))
    with pytest.raises(NonFiniteError, match=r"step 1: overflow of the gradient norm of \['logit.weight'\]: the "
                                             r"values are finite \(largest magnitude 3e\+19\)") as info:
        trainer.fit()
    assert info.value.tensors == ["logit.weight"] and info.value.step == 1
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_global_gradient_norm_overflow(tiny_config, tmp_path):
    """Every tensor's norm finite, their global norm not: the largest are named."""
    trainer = Trainer(tiny_config(), tmp_path)
    for p in (trainer.model.logit.weight, trainer.model.logit.bias):
        p.register_hook(lambda g: torch.full_like(g, 1.5e19 / g.numel() ** 0.5))  # norm 1.5e19 each
    with pytest.raises(NonFiniteError, match=r"step 1: overflow of the gradient norm: every gradient's norm is "
                                             r"finite but the global norm of the dense gradients \(inf\)") as info:
        trainer.fit()
    assert set(info.value.tensors[:2]) == {"logit.weight", "logit.bias"}


def test_divergence_from_a_huge_learning_rate_reports_the_overflow(tiny_config, tmp_path):
    with pytest.raises(NonFiniteError, match="overflow of the gradient norm") as info:
        Trainer(tiny_config("trainer.lr=1e3", "trainer.warmup_steps=0"), tmp_path).fit()
    assert info.value.tensors and "trainer.lr=1000" in str(info.value)


def test_eval_labels_of_one_class_stop_before_training(tiny_config, tmp_path, monkeypatch):
    """AUC and NE need both classes: such an eval set is refused before the first step, not reported as NaN."""
    from gem_lp.data import SyntheticSource

    original = SyntheticSource.eval_batches

    def all_positive(self, limit):
        for b in original(self, limit):
            b.labels.fill_(1.0)
            yield b

    monkeypatch.setattr(SyntheticSource, "eval_batches", all_positive)
    with pytest.raises(DataError, match=r"every one of the 32 eval labels is 1, so AUC and NE are undefined"):
        Trainer(tiny_config(), tmp_path)


def test_save_atomic_replaces_whole_files_only(tmp_path):
    path = tmp_path / "ckpt.pt"
    save_atomic({"a": torch.arange(3)}, path)
    with pytest.raises(Exception):
        save_atomic({"a": lambda: None}, path)  # not picklable: the old file must survive intact
    assert torch.equal(load_checkpoint(path)["a"], torch.arange(3))
    assert os.listdir(tmp_path) == ["ckpt.pt"]


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "mxfp8"])
def test_gpu_training_with_loader_workers(tiny_config, tmp_path, precision):
    """trainer=gpu end to end at small sizes: KJTs built in worker processes, pinned, moved with .to()."""
    cfg = tiny_config("trainer=gpu", f"model=gem_{precision}", "trainer.max_steps=12", "trainer.eval_every=6",
                      "trainer.eval_batches=2", "trainer.num_workers=2", "trainer.progress=false",
                      "trainer.tensorboard=false", "trainer.warmup_steps=2", "data.batch_size=64",
                      "data.num_items=1000", "data.history_mean=16", "data.history_max=100")
    metrics = Trainer(cfg, tmp_path).fit()
    assert metrics["device"] == torch.cuda.get_device_name() and metrics["steps"] == 12
    assert all(math.isfinite(x) for x in metrics["train_loss_history"])
    assert math.isfinite(metrics["eval_ne"]) and metrics["peak_mem_bytes"] > 0
    assert (tmp_path / "checkpoint.pt").is_file()


def test_pipelined_steps_train_as_the_synchronous_ones(tiny_config, tmp_path):
    """The pipelined loop (one process on a GPU: each step's check read one step late) on the CPU: the same losses
    and weights as the synchronous loop."""
    runs = {}
    for pipelined in (False, True):
        torch.manual_seed(0)
        trainer = Trainer(tiny_config("trainer.max_steps=7", "trainer.eval_every=4"), tmp_path / str(pipelined))
        trainer.pipelined = pipelined
        metrics = trainer.fit()
        runs[pipelined] = (trainer.losses, metrics["eval_history"], trainer.model.state_dict())
    assert len(runs[True][0]) == 7 and runs[True][0] == runs[False][0]
    assert runs[True][1] == runs[False][1]
    for k, v in runs[False][2].items():
        assert torch.equal(v, runs[True][2][k]), k
