"""What a training step keeps for the backward, by layer: the tensors autograd saves in the forward, in bytes.

    python -m benchmarks.profile_saved [trainer=gpu] model=gem_mxfp8 [overrides ...] [--top 25]

Builds the model and a batch from the same Hydra configs as `train.py` (on the config's device), runs one forward
under `torch.autograd.graph.saved_tensors_hooks` and attributes every saved tensor to the innermost module whose
forward was running (or to the op outside any module). A storage saved by several ops, or viewed by several saved
tensors, counts once, for the first to save it; parameters and buffers do not count (they are held anyway; a cast
copy of one does). Prints per module type and per module the bytes saved, their share,
and bytes per token of the batch (T tokens over the jagged sequences); the MXFP8 recipe is meant to keep MX payloads
and scales (about 1.03 bytes per element) where BF16 keeps 2 bytes per element. On the GPU the peak memory of a whole
step is also printed (saved tensors are a part of it: the backward's own buffers and the weights and optimizer state
add to them), and that of its forward and of the rest; with `--peak`, the step runs again under the allocator's trace
and what is live at the peak of each of these two phases is listed by the source line that allocated it
(`peak_by_site`).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from hydra import compose, initialize_config_module


def saved_by_module(model: torch.nn.Module, run) -> tuple[dict[str, int], dict[str, str], int]:
    """({module path: bytes saved}, {module path: module type}, total bytes) of `run()`'s saves, storages
    counted once."""
    stack: list[str] = []
    names = {m: n or "<model>" for n, m in model.named_modules()}
    kinds = {n or "<model>": type(m).__name__ for n, m in model.named_modules()}
    def enter(module, _inputs) -> None:
        stack.append(names[module])

    def leave(_module, _inputs, _output) -> None:  # returns None: the output stays the module's
        stack.pop()

    hooks = []
    for module in model.modules():
        hooks.append(module.register_forward_pre_hook(enter))
        hooks.append(module.register_forward_hook(leave))
    # the parameters and buffers are held anyway: a saved parameter costs nothing more (a saved cast copy does)
    seen = {(t.device, t.untyped_storage().data_ptr()) for t in (*model.parameters(), *model.buffers())}
    saved: dict[str, int] = defaultdict(int)

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        if key not in seen and storage.nbytes():
            seen.add(key)
            saved[stack[-1] if stack else "<outside modules>"] += storage.nbytes()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
    finally:
        for h in hooks:
            h.remove()
    kinds["<outside modules>"] = "-"
    return dict(saved), kinds, sum(saved.values())


OUR_CODE = ("gem_lp/", "benchmarks/")


def _short(frame: dict) -> str:
    path = frame["filename"]
    for part in OUR_CODE:
        if part in path:
            path = part + path.split(part, 1)[1]
            break
    return f"{path}:{frame['line']} {frame['name']}"


def _site(frames: list[dict]) -> str:
    """Where an allocation was made, from its stack (innermost frame first): the two innermost frames in our code
    (else the innermost Python frame), as `file:line function < caller`; '<no Python frame>' for allocations by
    autograd's C++ backward of a built-in op."""
    ours = [f for f in frames if any(part in f["filename"] for part in OUR_CODE)]
    chosen = ours[:2] or [f for f in frames if f["filename"].endswith(".py")][:1]
    return " < ".join(_short(f) for f in chosen) or "<no Python frame>"


def peak_by_site(trace: list[dict], start_bytes: int, begin: int = 0,
                 end: int | None = None) -> tuple[int, dict[str, int], int, str]:
    """Replays a device trace of the caching allocator (`torch.cuda.memory._snapshot()['device_traces'][d]`, events
    of `alloc` and `free_completed` with `addr`, `size`, `frames`) from `start_bytes` allocated when it began, to
    the peak within its events `[begin, end)` (a phase of the step; default all).

    Returns `(peak bytes, {site: bytes live at the peak}, bytes live at the peak that were allocated before the
    trace, the site of the allocation that reached the peak)`; sites as `_site`."""
    end = len(trace) if end is None else end
    current = peak = start_bytes
    peak_at = -1  # the event reaching the peak; -1: none in the window rose above what was live when it began
    for i, event in enumerate(trace[:end]):
        if i == begin:
            peak = current
        if event["action"] == "alloc":
            current += event["size"]
            if i >= begin and current > peak:
                peak, peak_at = current, i
        elif event["action"] == "free_completed":
            current -= event["size"]
    live: dict[int, dict] = {}
    for event in trace[:peak_at + 1 if peak_at >= 0 else begin]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    sites: dict[str, int] = defaultdict(int)
    for event in live.values():
        sites[_site(event.get("frames", []))] += event["size"]
    top = _site(trace[peak_at].get("frames", [])) if peak_at >= 0 else "<before the window>"
    return peak, dict(sites), peak - sum(sites.values()), top


PHASE_MARKER = "_forward_done_marker"


def _forward_done_marker(device: torch.device) -> None:
    """An allocation whose stack names this function: where the forward ends in the allocator's trace."""
    torch.empty(1, device=device)


def phase_split(trace: list[dict]) -> int:
    """Index of the marker allocation in `trace` (`_forward_done_marker`), or len(trace) when absent."""
    for i, event in enumerate(trace):
        if event["action"] == "alloc" and any(f.get("name") == PHASE_MARKER for f in event.get("frames", [])):
            return i
    return len(trace)


def traced_peak(step, device: torch.device) -> tuple[tuple, tuple]:
    """`peak_by_site` of one call of `step()` on `device`, traced with Python stacks, for its forward (the events
    before `_forward_done_marker`'s allocation, which `step` makes) and for the rest of the step."""
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=2_000_000)
    try:
        step()
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    index = device.index if device.index is not None else torch.cuda.current_device()
    trace = snapshot["device_traces"][index]
    split = phase_split(trace)
    return peak_by_site(trace, start, 0, split), peak_by_site(trace, start, split)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for train.py")
    parser.add_argument("--top", type=int, default=25, help="modules listed, largest first")
    parser.add_argument("--peak", action="store_true", help="GPU: list what is live at the step's peak by the "
                        "source line that allocated it")
    args = parser.parse_args()
    from gem_lp.train.trainer import Trainer

    with initialize_config_module(config_module="gem_lp.configs", version_base=None):
        # the towers eager unless asked: captured graphs hide their saves and hold memory pools of their own
        graphs_set = any(o.lstrip("+").split("=")[0] == "trainer.cuda_graphs" for o in args.overrides)
        cfg = compose(config_name="config", overrides=args.overrides + ([] if graphs_set else
                                                                         ["trainer.cuda_graphs=false"]))
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = Trainer(cfg, run_dir)
        batch = next(iter(trainer._train_loader())).to(trainer.device)
        tokens = int(batch.sequence_features.lengths().sum())
        model = trainer.model
        model.train()
        if trainer.device.type == "cuda":
            trainer.train_step(batch, 1)  # kernels built, optimizer state made
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(trainer.device)
            trainer.train_step(batch, 2)
            peak = torch.cuda.max_memory_allocated(trainer.device)
            forward_peak = []  # the forward's own peak, then the rest of the step's (backward, optimizers)

            def forward_done(_module, _inputs, _output):
                forward_peak.append(torch.cuda.max_memory_allocated(trainer.device))
                torch.cuda.reset_peak_memory_stats(trainer.device)

            hook = model.register_forward_hook(forward_done)
            torch.cuda.reset_peak_memory_stats(trainer.device)
            try:
                trainer.train_step(batch, 3)
            finally:
                hook.remove()
            phases = (forward_peak[0], torch.cuda.max_memory_allocated(trainer.device))
            traced = None
            if args.peak:
                hook = model.register_forward_hook(lambda *_: _forward_done_marker(trainer.device))
                try:
                    traced = traced_peak(lambda: trainer.train_step(batch, 4), trainer.device)
                finally:
                    hook.remove()
        else:
            peak = traced = phases = None
        per_module, kinds, total = saved_by_module(model, lambda: model(batch))
        precision = trainer.mcfg.precision
        trainer.close()
    by_kind: dict[str, int] = defaultdict(int)
    for name, nbytes in per_module.items():
        by_kind[kinds.get(name, "?")] += nbytes
    result = {"config": args.overrides, "precision": precision, "history_tokens": tokens,
              "saved_bytes": total, "saved_bytes_per_history_token": total / max(tokens, 1),
              "peak_step_bytes": peak, "peak_forward_bytes": phases and phases[0],
              "peak_after_forward_bytes": phases and phases[1], "by_module_type": dict(by_kind),
              "by_module": per_module}
    if traced is not None:
        for phase, t in zip(("forward", "after_forward"), traced):
            result[f"traced_{phase}"] = dict(peak_bytes=t[0], live_at_peak_by_site=t[1], live_at_peak_from_before=t[2],
                                             peak_reached_at=t[3])
    out = Path(os.environ.get("OUT", ".bench_out"))
    out.mkdir(parents=True, exist_ok=True)
    name = "profile_saved_" + "_".join(o.replace("=", "-").replace("/", "-") for o in args.overrides)
    (out / f"{name[:150]}.json").write_text(json.dumps(result, indent=1))
    print(f"{'module type':28} {'saved MB':>10} {'share':>7} {'B/token':>9}")
    for kind, nbytes in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"{kind:28} {nbytes / 1e6:10.2f} {nbytes / total:7.1%} {nbytes / max(tokens, 1):9.1f}")
    print()
    print(f"{'module':52} {'saved MB':>10} {'B/token':>9}")
    for mod, nbytes in sorted(per_module.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{mod:52} {nbytes / 1e6:10.2f} {nbytes / max(tokens, 1):9.1f}")
    for phase, t in zip(("the forward", "the backward and update"), traced or ()):
        print(f"\nlive at the traced step's peak in {phase} ({t[0] / 1e9:.2f} GB, reached allocating at {t[3]}):")
        print(f"{'allocated before the step (parameters, optimizer state, batch, ...)':90} {t[2] / 1e6:10.2f} MB")
        for site, nbytes in sorted(t[1].items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"{site[:90]:90} {nbytes / 1e6:10.2f} MB")
    print(f"\n{precision}: {total / 1e6:.2f} MB saved for the backward, {total / max(tokens, 1):.1f} bytes per history "
          f"token ({tokens} tokens)" + ("" if peak is None else f"; peak of a training step {peak / 1e9:.2f} GB "
                                        f"(forward {phases[0] / 1e9:.2f}, backward and update {phases[1] / 1e9:.2f})"))


if __name__ == "__main__":
    main()
