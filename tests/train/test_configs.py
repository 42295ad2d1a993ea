"""Every shipped yaml composes, and every composed section builds its (validating) dataclass."""
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from gem_lp.data import SyntheticDataConfig
from gem_lp.models import GemModelConfig
from gem_lp.train import TrainerConfig

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
GROUPS = ("model", "data", "trainer", "experiment")


def shipped_choices():
    choices = [None]
    for path in sorted(CONFIG_DIR.rglob("*.yaml")):
        rel = path.relative_to(CONFIG_DIR)
        if rel == Path("config.yaml"):
            continue
        assert len(rel.parts) == 2 and rel.parts[0] in GROUPS, f"unexpected config file {rel}"
        choices.append(f"{rel.parts[0]}={path.stem}")
    return choices


def build_sections(cfg):
    model = GemModelConfig.from_mapping(OmegaConf.to_container(cfg.model, resolve=True))
    data = SyntheticDataConfig.from_mapping(OmegaConf.to_container(cfg.data, resolve=True))
    trainer = TrainerConfig.from_mapping(OmegaConf.to_container(cfg.trainer, resolve=True))
    return model, data, trainer


@pytest.mark.parametrize("choice", shipped_choices())
def test_every_config_composes(composed, choice):
    cfg = composed(*([choice] if choice else []))
    model, data, trainer = build_sections(cfg)
    assert isinstance(cfg.seed, int) and cfg.resume is False
    assert model.d_model % 32 == 0 and data.batch_size > 0 and trainer.max_steps > 0


def test_defaults_and_precision_choice(composed):
    model, _, trainer = build_sections(composed())
    assert model.precision == "bf16" and trainer.device == "cpu"
    mx, _, _ = build_sections(composed("model=gem_mxfp8"))
    assert mx.precision == "mxfp8" and mx.qk_rotation == "hadamard" and model.qk_rotation is None
    # the recipes differ in precision and in MXFP8's Hadamard rotation of q and k only
    assert {**vars(mx), "precision": "bf16", "qk_rotation": None} == vars(model)


@pytest.mark.parametrize("value, want", [("null", None), ("hadamard", "hadamard")])
def test_qk_rotation_override(composed, value, want):
    for choice in ("model=gem_bf16", "model=gem_mxfp8"):
        model, _, _ = build_sections(composed(choice, f"model.qk_rotation={value}"))
        assert model.qk_rotation == want
    with pytest.raises(ValueError, match="model.qk_rotation must be null or hadamard"):
        build_sections(composed("model.qk_rotation=givens"))


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
        model, _, _ = build_sections(composed(*overrides))
        seen.add((model.precision, model.qk_rotation))
    assert seen == {(p, r) for p in ("bf16", "mxfp8") for r in (None, "hadamard")}


def test_gpu_sizes_follow_the_tensor_core_tiles(composed):
    model, data, trainer = build_sections(composed("trainer=gpu", "model=gem_mxfp8"))
    assert trainer.device == "cuda" and model.precision == "mxfp8"
    assert model.head_dim == 128
    for width in (model.d_model, model.embedding_dim, model.mlp_hidden, model.dense_hidden, model.head_hidden):
        assert width % 128 == 0
    assert data.batch_size >= 512
