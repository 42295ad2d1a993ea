"""Packaging: the configs ship inside the package, every third-party import is a declared dependency, and the
trainer runs as `python -m gem_lp.train` from any directory."""
import ast
import fnmatch
import re
import sys
import tomllib

from train_helpers import ROOT, run_cli

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# The distribution behind each third-party module gem_lp imports.
DISTRIBUTIONS = {"torch": "torch", "triton": "triton", "hydra": "hydra-core", "omegaconf": "omegaconf",
                 "numpy": "numpy", "tqdm": "tqdm", "pyarrow": "pyarrow", "torchrec": "torchrec",
                 "fbgemm_gpu": "fbgemm-gpu", "matplotlib": "matplotlib", "tensorboard": "tensorboard",
                 "yaml": "omegaconf",  # PyYAML comes with omegaconf
                 "cutlass": "nvidia-cutlass-dsl", "flash_attn": "flash-attn-4", "quack": "quack-kernels",
                 "cuda": "cuda-bindings"}


def _names(requirements):
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_configs_are_package_data():
    patterns = PYPROJECT["tool"]["setuptools"]["package-data"]["gem_lp.configs"]
    configs = ROOT / "gem_lp" / "configs"
    files = [p.relative_to(configs).as_posix() for p in configs.rglob("*.yaml")]
    assert len(files) >= 10 and (configs / "__init__.py").is_file()
    for name in files:
        assert any(fnmatch.fnmatch(name, pattern) and name.count("/") == pattern.count("/")
                   for pattern in patterns), name
    assert not (ROOT / "configs").exists()  # one copy: the packaged one


def test_entry_points_and_extras():
    assert PYPROJECT["project"]["scripts"] == {"gem-lp-train": "gem_lp.train.cli:main"}
    extras = {k: _names(v) for k, v in PYPROJECT["project"]["optional-dependencies"].items()}
    assert {"torchrec", "fbgemm-gpu"} <= extras["gpu"] and extras["cpu"] == {"fbgemm-gpu-cpu"}


def test_every_third_party_import_is_declared():
    declared = _names(PYPROJECT["project"]["dependencies"])
    for extra in PYPROJECT["project"]["optional-dependencies"].values():
        declared |= _names(extra)
    imported = set()
    for path in (ROOT / "gem_lp").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - {"gem_lp"}
    unknown = third_party - set(DISTRIBUTIONS)
    assert not unknown, f"imports without a known distribution: {unknown}"
    missing = {m for m in third_party if DISTRIBUTIONS[m] not in declared}
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_python_m_gem_lp_train_runs_from_another_directory(tmp_path):
    out = run_cli("-m", "gem_lp.train", "--cfg", "job", "model=gem_mxfp8", cwd=tmp_path)
    assert "precision: mxfp8" in out.stdout and "batch_size: 128" in out.stdout
    assert list(tmp_path.iterdir()) == []  # --cfg prints, it runs nothing
