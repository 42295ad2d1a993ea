"""Configs: every shipped yaml composes into the structured schema; types and ranges are checked with one-line
errors naming the key, before a run directory exists."""
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from gem_lp.data import ParquetDataConfig, SyntheticDataConfig
from gem_lp.models import GemModelConfig
from gem_lp.train import ConfigError, RunConfig, TrainerConfig, load_run_config
from gem_lp.train.trainer import check_run_directory

from train_helpers import CONFIG_DIR, TRAIN_PY, run_cli

GROUPS = ("model", "data", "trainer", "experiment")


def shipped_choices():
    choices = [None]
    for path in sorted(CONFIG_DIR.rglob("*.yaml")):
        rel = path.relative_to(CONFIG_DIR)
        if rel == Path("config.yaml") or rel.parts[0] == "data_sizes":  # data_sizes: chosen by config.yaml itself
            continue
        assert len(rel.parts) == 2 and rel.parts[0] in GROUPS, f"unexpected config file {rel}"
        choice = f"{rel.parts[0]}={path.stem}"
        choices.append(f"{choice} data.path=logs.parquet data.num_items=10 data.dense_features=[x] "
                       "data.pooled_features=[{column:u,num_embeddings:3}]" if choice == "data=parquet" else choice)
    return choices


@pytest.mark.parametrize("choice", shipped_choices())
def test_every_config_composes(composed, choice):
    run = load_run_config(composed(*(choice.split() if choice else [])))
    assert isinstance(run, RunConfig) and isinstance(run.seed, int) and run.resume is False
    assert isinstance(run.model, GemModelConfig) and isinstance(run.trainer, TrainerConfig)
    assert isinstance(run.data, ParquetDataConfig if choice and "parquet" in choice else SyntheticDataConfig)
    assert run.model.d_model % 32 == 0 and run.data.batch_size > 0 and run.trainer.max_steps > 0


def test_defaults_and_precision_choice(composed):
    run = load_run_config(composed())
    assert run.model.precision == "bf16" and run.trainer.device == "cpu"
    mx = load_run_config(composed("model=gem_mxfp8")).model
    assert mx.precision == "mxfp8" and mx.qk_rotation == "hadamard" and run.model.qk_rotation is None
    # the recipes differ in precision and in MXFP8's Hadamard rotation of q and k only
    assert {**vars(mx), "precision": "bf16", "qk_rotation": None} == vars(run.model)


@pytest.mark.parametrize("value, want", [("null", None), ("hadamard", "hadamard")])
def test_qk_rotation_override(composed, value, want):
    for choice in ("model=gem_bf16", "model=gem_mxfp8"):
        assert load_run_config(composed(choice, f"model.qk_rotation={value}")).model.qk_rotation == want
    with pytest.raises(ConfigError, match="model.qk_rotation must be null or hadamard, got 'givens'"):
        load_run_config(composed("model.qk_rotation=givens"))


def test_rotation_sweep_expands_into_four_valid_runs(composed):
    """`python train.py -m model=gem_bf16,gem_mxfp8 model.qk_rotation=null,hadamard`, expanded by Hydra's own
    sweeper and parser, composes four runs with every combination."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    sweep = ["model=gem_bf16,gem_mxfp8", "model.qk_rotation=null,hadamard"]
    parsed = OverridesParser.create().parse_overrides(sweep)
    (jobs,) = BasicSweeper.split_arguments(parsed, max_batch_size=None)
    assert len(jobs) == 4
    seen = set()
    for overrides in jobs:
        model = load_run_config(composed(*overrides)).model
        seen.add((model.precision, model.qk_rotation))
    assert seen == {(p, r) for p in ("bf16", "mxfp8") for r in (None, "hadamard")}


def test_gpu_sizes_follow_the_tensor_core_tiles(composed):
    run = load_run_config(composed("trainer=gpu", "model=gem_mxfp8"))
    model, data, trainer = run.model, run.data, run.trainer
    assert trainer.device == "cuda" and model.precision == "mxfp8"
    assert model.head_dim == 128
    for width in (model.d_model, model.embedding_dim, model.mlp_hidden, model.dense_hidden, model.head_hidden):
        assert width % 128 == 0
    assert data.batch_size >= 512 and data.history_mean == 256.0
    parquet = load_run_config(composed("trainer=gpu", "data=parquet", "data.path=x", "data.num_items=5",
                                       "data.dense_features=[a]", "data.pooled_features=[{column:u,num_embeddings:3}]"))
    assert parquet.data.batch_size == 1024  # trainer=gpu composes with the Parquet source too
    assert parquet.trainer.num_workers == 8 and parquet.trainer.eval_batches is None  # loader workers, whole eval


@pytest.mark.parametrize("override", ["trainer.lr=abc", "seed=abc", "trainer.max_steps=1.5", "model.causal=maybe",
                                      "data.batch_size=[1]", "trainer.no_such_key=1"])
def test_types_are_checked_when_the_config_is_composed(composed, override):
    with pytest.raises(ConfigCompositionException) as info:
        composed(override)
    assert override.split("=")[0] in str(info.value) + str(info.value.__cause__)


@pytest.mark.parametrize("overrides, message", [
    (["data.history_min=0", "data.history_max=0"], "data.history_min and data.history_max must satisfy"),
    (["data.num_items=1"], "data.num_items must be >= 2, got 1"),
    (["trainer.max_steps=0"], "trainer.max_steps must be >= 1, got 0"),
    (["trainer.lr=-1"], "trainer.lr must be a finite number > 0, got -1"),
    (["trainer.betas=[0.9]"], "trainer.betas must be [beta1, beta2]"),
    (["trainer.decay=step"], "trainer.decay must be one of"),
    (["model.head_dim=48"], "model.head_dim must be a positive multiple of 32, got 48"),
    (["resume=maybe"], "resume must be false, true or force, got 'maybe'"),
    (["seed=-1"], "seed must be an integer in [0, 2**63)"),
    (["data=parquet"], "data.num_items, data.path, data.pooled_features: values are required"),
    (["data=parquet", "data.num_items=5"], "data.path, data.pooled_features: values are required"),
    (["data=parquet", "data.path=x", "data.num_items=5", "data.pooled_features=[]"],
     "data.pooled_features must list at least one"),
    (["trainer.eval_batches=0"], "trainer.eval_batches must be null (the whole eval set) or >= 1, got 0"),
    (["trainer.embedding_weight_decay=-1"], "trainer.embedding_weight_decay must be a finite number >= 0, got -1"),
    (["trainer.checkpoint_every=0"], "trainer.checkpoint_every must be null (no checkpoints) or >= 1, got 0"),
    (["trainer.checkpoint_every=null", "trainer.stop_after=2"], "trainer.stop_after stops the run with a checkpoint"),
])
def test_ranges_are_checked_with_one_line_errors(composed, overrides, message):
    with pytest.raises(ConfigError) as info:
        load_run_config(composed(*overrides))
    text = str(info.value)
    assert message in text and "\n" not in text


def test_checkpoint_path_must_not_be_a_directory(composed, tmp_path):
    run = load_run_config(composed(f"trainer.checkpoint_path={tmp_path}"))
    with pytest.raises(ConfigError, match=f"trainer.checkpoint_path: expected a file path, got the directory "
                                          f"{tmp_path}"):
        check_run_directory(run, tmp_path / "run")


def test_cuda_without_a_device_is_a_config_error(monkeypatch):
    from gem_lp.train.trainer import resolve_device

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ConfigError, match="trainer.device=cuda but no CUDA device is visible"):
        resolve_device("cuda")


def test_dataclasses_and_schema_agree():
    """The yaml defaults pass the same checks as the dataclasses' own defaults."""
    assert OmegaConf.to_object(OmegaConf.structured(TrainerConfig)) == TrainerConfig()
    assert TrainerConfig(betas=[0.5, 0.6]).betas == (0.5, 0.6)


def test_bad_config_from_the_command_line_leaves_no_run_directory(tmp_path):
    """A range error and a sweep job's type error: one line on stderr, exit status 1, and no outputs/ or multirun/."""
    bad = run_cli(TRAIN_PY, "data.history_min=0", "data.history_max=0",
                  cwd=tmp_path, check=False)
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines()[-1] == ("data.history_min and data.history_max must satisfy 0 <= min <= "
                                                   "max and max >= 1, got 0, 0")
    sweep = run_cli(TRAIN_PY, "-m", "trainer.lr=1e-3,abc", "experiment=smoke",
                    cwd=tmp_path, check=False)
    assert sweep.returncode == 1
    last = sweep.stderr.strip().splitlines()[-1]
    assert "trainer.lr=abc" in last and "could not be converted to Float" in last
    assert list(tmp_path.iterdir()) == []


def test_cuda_graphs_need_one_process_on_a_cuda_device(tiny_config, tmp_path):
    from gem_lp.train.trainer import Trainer

    with pytest.raises(ConfigError, match="trainer.cuda_graphs=true needs one process on a CUDA device, got device "
                                          "cpu"):
        Trainer(tiny_config("trainer.cuda_graphs=true"), tmp_path)


def test_cuda_graphs_default_to_one_process_on_a_cuda_device(tiny_config, tmp_path):
    from gem_lp.train.trainer import Trainer

    assert tiny_config().trainer.cuda_graphs is None
    assert Trainer(tiny_config(), tmp_path / "run").cuda_graphs is False  # the CPU: towers stay eager


def test_sequence_graph_buckets_must_not_be_negative(tiny_config, tmp_path):
    from gem_lp.train.trainer import Trainer

    with pytest.raises((ConfigError, ValueError), match="trainer.sequence_graph_buckets must be >= 0, got -1"):
        Trainer(tiny_config("trainer.sequence_graph_buckets=-1"), tmp_path)
