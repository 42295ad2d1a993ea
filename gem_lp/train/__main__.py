"""`python -m gem_lp.train [overrides]`: the same command as `python train.py`."""
from .cli import main

if __name__ == "__main__":
    main()
