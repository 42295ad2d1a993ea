"""On the GPU, the cast kernel's first use of a launch also compiles the builds that other token counts of its class
select (`triton_cast._compile_token_count_variants`: no compile in the middle of training). Tests of single calls
do not need them; only the tests marked `up_front_builds` make them (as in tests/linear)."""
import pytest
import torch

from gem_lp.mx.kernels import triton_cast


@pytest.fixture(autouse=True)
def _lazy_variant_builds(request, monkeypatch):
    if torch.cuda.is_available() and "up_front_builds" not in request.keywords:
        monkeypatch.setattr(triton_cast, "_compile_token_count_variants", lambda *args, **kwargs: False)
