"""What runs where, and whether it works here.

    python -m gem_lp.selfcheck --plan [--arch cpu|sm_90|sm_100|cuda]   the dispatch table of this device (or an arch)
    python -m gem_lp.selfcheck                                          on a GPU: check and time every kernel of the
                                                                        plan, one line each

`--plan` prints one line per op and precision: the implementation the plan takes, or `reference`, and why. Without
it, on a GPU, every implementation of the plan that has a self-check runs it in this process (odd lengths and an
outlier case against the reference) and is timed beside its peer in the same process (FA4 BF16 for attention, cuBLAS
BF16 for the linears, a device copy for casts, torch for the norms); exit status 1 when a check fails. The verdicts
go to the same on-disk cache as the checks the trainer and the ops run on first use (`gem_lp.runtime.selfcheck`).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from gem_lp.runtime import dispatch, selfcheck


def _print_plan(arch: str) -> None:
    print(f"plan for {arch} (op, precision, arch, implementation, what it is [why not a better one])")
    for choice in dispatch.plan(arch):
        print(choice.line())


def _checks(device: torch.device) -> int:
    arch = dispatch.arch_of(device)
    print(f"self-check on {torch.cuda.get_device_name(device)} ({arch})")
    failures = 0
    for choice in dispatch.plan(arch):
        impl = dispatch.IMPLS[(choice.op, choice.precision)][choice.impl]
        if impl.check is None:
            continue
        key = dispatch.impl_key(choice.op, choice.precision, choice.impl, arch)
        out = selfcheck.run_check(key, device, timed=True)
        selfcheck.record(device, key, out)  # what later processes on this device find, as a first use's check
        failures += not out["passed"]
        speed = out["details"].get("speed", "")
        print(f"{'PASS' if out['passed'] else 'FAIL'} {key:40s} {out['summary']}" + (f" | {speed}" if speed else ""),
              flush=True)
    print(f"selfcheck: {failures} failed")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plan", action="store_true", help="print the dispatch table and exit")
    ap.add_argument("--arch", choices=dispatch.ARCHES, default=None, help="the plan of this arch (default: here)")
    ap.add_argument("--run", metavar="KEY", help="run one implementation's check (op/precision/impl/arch)")
    ap.add_argument("--device", default="cuda", help="the GPU to check (default: the current one)")
    ap.add_argument("--json", action="store_true", help="with --run: print the verdict as one JSON line")
    args = ap.parse_args(argv)
    if args.plan:
        here = dispatch.arch_of(torch.device(args.device)) if torch.cuda.is_available() else "cpu"
        _print_plan(args.arch or here)
        return 0
    if not torch.cuda.is_available():
        _print_plan(args.arch or "cpu")
        print("no GPU here: nothing to check (the plan above runs the reference)")
        return 0
    device = torch.device(args.device)
    if args.run:
        out = selfcheck.run_check(args.run, device)
        print(json.dumps(out) if args.json else f"{'PASS' if out['passed'] else 'FAIL'} {args.run} {out['summary']}")
        return 0 if out["passed"] else 1
    return _checks(device)


if __name__ == "__main__":
    sys.exit(main())
