"""Resume: changed trainer settings refused unless allowed (and recorded); a run directory's checkpoint is never
overwritten without resume=true."""
import json

import pytest

from gem_lp.train import RESUME_MAY_CHANGE, ConfigError, RunDirectoryInUse, Trainer
from gem_lp.train.optim import warmup_decay_lambda

from train_helpers import TINY, TRAIN_PY, run_cli

COMMON = ["trainer.max_steps=8", "trainer.eval_every=4", "trainer.checkpoint_every=4", "trainer.warmup_steps=2"]


@pytest.fixture
def stopped_run(tiny_config, tmp_path):
    """A run stopped (with a checkpoint) at step 4 of 8."""
    Trainer(tiny_config(*COMMON, "trainer.stop_after=4"), tmp_path).fit()
    return tmp_path


def test_changed_learning_rate_is_refused(tiny_config, stopped_run):
    with pytest.raises(ConfigError, match=r"resume=true: trainer settings differ from the checkpoint's \(trainer.lr: "
                                          r"0.005 in the checkpoint, 0.001 now; trainer.weight_decay: 0.01 in the "
                                          r"checkpoint, 0.0 now\).*resume=force"):
        Trainer(tiny_config(*COMMON, "resume=true", "trainer.lr=1e-3", "trainer.weight_decay=0"), stopped_run)


def test_resume_force_continues_with_the_new_settings_and_records_them(tiny_config, stopped_run):
    trainer = Trainer(tiny_config(*COMMON, "resume=force", "trainer.lr=1e-3", "trainer.weight_decay=0"), stopped_run)
    schedule = warmup_decay_lambda(2, 8, "cosine", 0.1)
    group = trainer.dense_optimizer.param_groups[0]
    assert group["lr"] == pytest.approx(1e-3 * schedule(4)) and group["weight_decay"] == 0.0
    assert trainer.dense_scheduler.get_last_lr() == [group["lr"]]
    metrics = trainer.fit()
    lrs = [g["lr"] for g in trainer.dense_optimizer.param_groups]
    assert lrs == [pytest.approx(1e-3 * schedule(8))]  # the new base LR on the schedule to the end
    (record,) = metrics["resumes"]
    assert record["step"] == 4 and record["forced"] is True
    assert record["changed"] == {"trainer.lr": {"checkpoint": 0.005, "now": 0.001},
                                 "trainer.weight_decay": {"checkpoint": 0.01, "now": 0.0},
                                 "trainer.stop_after": {"checkpoint": 4, "now": None}}
    assert json.loads((stopped_run / "metrics.json").read_text())["resumes"] == metrics["resumes"]


def test_listed_settings_may_change_with_resume_true(tiny_config, stopped_run):
    assert "max_steps" in RESUME_MAY_CHANGE and "lr" not in RESUME_MAY_CHANGE
    trainer = Trainer(tiny_config(*COMMON, "resume=true", "trainer.max_steps=12", "trainer.eval_every=6"), stopped_run)
    schedule = warmup_decay_lambda(2, 12, "cosine", 0.1)  # recomputed for the new length
    assert trainer.dense_optimizer.param_groups[0]["lr"] == pytest.approx(5e-3 * schedule(4))
    metrics = trainer.fit()
    assert metrics["steps"] == 12
    assert metrics["resumes"] == [{"step": 4, "checkpoint": str(stopped_run / "checkpoint.pt"), "forced": False,
                                   "changed": {"trainer.max_steps": {"checkpoint": 8, "now": 12},
                                               "trainer.eval_every": {"checkpoint": 4, "now": 6},
                                               "trainer.stop_after": {"checkpoint": 4, "now": None}}}]


def test_model_and_data_stay_checked_under_force(tiny_config, stopped_run):
    with pytest.raises(ConfigError, match="data config differs"):
        Trainer(tiny_config(*COMMON, "resume=force", "data.zipf_exponent=1.3"), stopped_run)


def test_a_finished_run_is_not_overwritten(tiny_config, tmp_path):
    Trainer(tiny_config("trainer.max_steps=4"), tmp_path).fit()
    before = (tmp_path / "checkpoint.pt").read_bytes(), (tmp_path / "metrics.json").read_bytes()
    with pytest.raises(RunDirectoryInUse, match=f"{tmp_path} already holds a checkpoint \\(checkpoint.pt\\) from an "
                                                f"earlier run; pass resume=true"):
        Trainer(tiny_config("trainer.max_steps=2"), tmp_path)
    assert ((tmp_path / "checkpoint.pt").read_bytes(), (tmp_path / "metrics.json").read_bytes()) == before
    custom = tmp_path / "elsewhere" / "ckpt.pt"
    Trainer(tiny_config("trainer.max_steps=2", f"trainer.checkpoint_path={custom}"), tmp_path / "a").fit()
    with pytest.raises(RunDirectoryInUse, match=f"{custom.parent} already holds a checkpoint \\(ckpt.pt\\)"):
        Trainer(tiny_config("trainer.max_steps=2", f"trainer.checkpoint_path={custom}"), tmp_path / "b")


def test_the_command_line_refuses_before_touching_the_run_directory(tmp_path):
    """Reusing hydra.run.dir without resume=true: one-line error, exit 1, the earlier run's files untouched
    (Hydra's own .hydra/ record included)."""
    run_dir = tmp_path / "exp1"
    args = [TRAIN_PY, f"hydra.run.dir={run_dir}", *TINY, "trainer.max_steps=4"]
    run_cli(*args, cwd=tmp_path)
    files = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    refused = run_cli(*args, "trainer.max_steps=2", cwd=tmp_path, check=False)
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines()[-1].startswith(f"{run_dir} already holds a checkpoint (checkpoint.pt)")
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == files
