"""`benchmarks.profile_saved.saved_by_module`: attribution of saved tensors to modules, on the CPU."""
import torch
from torch import nn

from benchmarks.profile_saved import saved_by_module


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Sequential(nn.Linear(16, 4))

    def forward(self, x):
        h = torch.sigmoid(self.a(x))  # the sigmoid's output is saved outside any submodule: the model's
        return self.b(h).exp()


def test_saved_bytes_by_module_storages_once_parameters_not_counted():
    net = Net()
    x = torch.randn(5, 8, requires_grad=True)
    per_module, kinds, total = saved_by_module(net, lambda: net(x))
    # a saves its input x (5x8 fp32); the model saves the sigmoid's output h (5x16) and exp's output (5x4); b.0's
    # save of h is the same storage, counted once, for the sigmoid, which saved it first; weights do not count
    assert per_module["a"] == 5 * 8 * 4
    assert per_module["<model>"] == 5 * 16 * 4 + 5 * 4 * 4
    assert "b.0" not in per_module  # h was saved first by the sigmoid: one storage, counted once
    assert total == sum(per_module.values()) and kinds["b.0"] == "Linear" and kinds["<model>"] == "Net"


def test_peak_by_site_replays_the_trace_to_its_peak():
    from benchmarks.profile_saved import peak_by_site

    def frame(name, line):
        return {"filename": f"/site/gem_lp/{name}.py", "line": line, "name": name}

    torch_frame = {"filename": "/site/torch/nn/functional.py", "line": 1, "name": "linear"}
    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": [torch_frame, frame("mlp", 10), frame("model", 5)]},
        {"action": "alloc", "addr": 2, "size": 50, "frames": [frame("attention", 20)]},
        {"action": "free_completed", "addr": 7, "size": 30, "frames": []},  # made before the trace
        {"action": "alloc", "addr": 3, "size": 40, "frames": []},  # the peak: 1000 + 100 + 50 - 30 + 40 = 1160
        {"action": "free_requested", "addr": 2, "size": 50, "frames": []},  # not yet free
        {"action": "free_completed", "addr": 2, "size": 50, "frames": []},
        {"action": "alloc", "addr": 4, "size": 40, "frames": [frame("attention", 21)]},  # 1150: below the peak
    ]
    peak, sites, before, top = peak_by_site(trace, 1000)
    assert peak == 1160 and top == "<no Python frame>"
    assert sites == {"gem_lp/mlp.py:10 mlp < gem_lp/model.py:5 model": 100, "gem_lp/attention.py:20 attention": 50,
                     "<no Python frame>": 40}
    assert before == 1160 - 190


def test_peak_by_site_within_a_window_and_the_phase_marker():
    from benchmarks.profile_saved import PHASE_MARKER, peak_by_site, phase_split

    def frame(name):
        return {"filename": f"/site/gem_lp/{name}.py", "line": 1, "name": name}

    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": [frame("forward")]},   # 100: the forward's peak
        {"action": "free_completed", "addr": 1, "size": 100, "frames": []},
        {"action": "alloc", "addr": 2, "size": 1, "frames": [frame(PHASE_MARKER)]},  # 1
        {"action": "alloc", "addr": 3, "size": 60, "frames": [frame("backward")]},   # 61: the rest's peak
        {"action": "free_completed", "addr": 3, "size": 60, "frames": []},
    ]
    split = phase_split(trace)
    assert split == 2 and phase_split(trace[:2]) == 2
    assert peak_by_site(trace, 0, 0, split)[:2] == (100, {"gem_lp/forward.py:1 forward": 100})
    peak, sites, before, top = peak_by_site(trace, 0, split)
    assert peak == 61 and top == "gem_lp/backward.py:1 backward" and before == 0
    assert sites == {f"gem_lp/{PHASE_MARKER}.py:1 {PHASE_MARKER}": 1, "gem_lp/backward.py:1 backward": 60}
    # a window with no allocation above what was live when it began: its start
    assert peak_by_site(trace, 0, 4)[:2] == (61, {f"gem_lp/{PHASE_MARKER}.py:1 {PHASE_MARKER}": 1,
                                                  "gem_lp/backward.py:1 backward": 60})
