"""The CuTe DSL RMSNorm + MX cast kernel (`kernel.py`), its launch table per architecture (`config.py`), host launch
(`launch.py`), the RMSNorm backward (`backward.py`: quack's kernel, built here) and builds for `gem_lp.compile_check`
(`targets.py`)."""
