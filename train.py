"""Train the GEM-like ranking model: `python train.py [model=gem_mxfp8] [trainer=gpu] [key=value ...]`.

Writes `metrics.json`, `checkpoint.pt`, `train.log` and TensorBoard events into the Hydra run directory.
The same command is `python -m gem_lp.train` or `gem-lp-train` once the package is installed.
"""
from gem_lp.train.cli import main

if __name__ == "__main__":
    main()
