"""The CuTe DSL RMSNorm + MX cast kernel (`kernel.py`), its launch table per architecture (`config.py`), host launch
(`launch.py`) and builds for `gem_lp.compile_check` (`targets.py`)."""
