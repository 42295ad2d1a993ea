"""Train the GEM-like ranking model: `python train.py [model=gem_mxfp8] [trainer=gpu] [key=value ...]`.

Writes `metrics.json`, `checkpoint.pt` and TensorBoard events into the Hydra run directory.
"""
import os

# Jagged batches give every GEMM a new shape; oneDNN's per-shape primitive cache would then grow to
# gigabytes on the CPU (bfloat16) without ever hitting. Read when torch initializes oneDNN.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16")

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig  # noqa: E402


@hydra.main(config_path="configs", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    from gem_lp.train import train  # imported here so `--help` and config errors stay fast

    metrics = train(cfg, HydraConfig.get().runtime.output_dir)
    print(f"done: {metrics['steps']} steps, eval AUC {metrics['eval_auc']:.4f} (teacher {metrics['teacher_auc']:.4f}), "
          f"eval NE {metrics['eval_ne']:.4f}, {metrics['samples_per_s']:,.0f} samples/s")
    return metrics["eval_ne"]


if __name__ == "__main__":
    main()
