"""The op x architecture table: which implementation each op takes, per precision, on each kind of device.

Every op asks `choose(op, precision, device, backend)` for its implementation; nothing else in the package decides
which kernel runs on which architecture. The table (`TABLE`) lists, per op and precision and per architecture
(`cpu`, `sm_90`, `sm_100` for sm_100/sm_103, `cuda` for any other GPU), the implementations in order of preference;
the plan of a device takes the first one whose toolchain is installed and whose first-use self-check (GPU kernels,
`gem_lp.runtime.selfcheck`) has not failed on this device, else `reference` (plain PyTorch), saying why. A GPU run
that takes the reference for an op warns once per process, naming op, arch and why.

`python -m gem_lp.selfcheck --plan [--arch ...]` prints the plan; the trainer logs it and records it in
`metrics.json`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import warnings

import torch

from gem_lp.runtime.device import capability, cute_stack_missing, interpreter_enabled, triton_missing

log = logging.getLogger("gem_lp")

BACKENDS = ("auto", "reference", "triton", "cute")
ARCHES = ("cpu", "sm_90", "sm_100", "cuda")


@dataclasses.dataclass(frozen=True)
class Impl:
    """One implementation of an op: `toolchain` ("triton", "cute" or None for plain torch), what it is in a few words,
    whether a CUDA graph can capture it (no host sync), and its first-use self-check (`module:function`, None for
    implementations that are not GPU kernels of ours)."""

    name: str
    toolchain: str | None
    summary: str
    capture_safe: bool = True
    check: str | None = None
    fit_for_gpu: bool = False  # a reference that is torch's own GPU kernel: taking it on a GPU is no fallback
    cpu_model: bool = False  # a CuTe implementation that runs a CPU model of its kernels in an emulated plan


REFERENCE = "reference"


def _impls(*impls: Impl) -> dict[str, Impl]:
    return {i.name: i for i in impls}


_REF = Impl(REFERENCE, None, "plain PyTorch (the test oracle)")
_REF_HOST_SYNC = Impl(REFERENCE, None, "plain PyTorch (the test oracle); copies the offsets to the host",
                      capture_safe=False)

# (op, precision) -> its implementations and, per arch, the order in which the plan tries them (the reference is
# always the last resort and is not listed).
IMPLS: dict[tuple[str, str], dict[str, Impl]] = {
    ("quantize", "mxfp8"): _impls(_REF, Impl("triton", "triton", "Triton MX cast", check="gem_lp.mx.selfchecks:quantize")),
    ("quantize_dual", "mxfp8"): _impls(
        _REF, Impl("cute", "cute", "CuTe dual MX cast", check="gem_lp.mx.selfchecks:quantize_dual_cute"),
        Impl("triton", "triton", "Triton dual MX cast", check="gem_lp.mx.selfchecks:quantize_dual_triton")),
    ("quantize_jagged", "mxfp8"): _impls(
        _REF, Impl("triton", "triton", "Triton zero-gather jagged cast", check="gem_lp.jagged.selfchecks:quantize_jagged")),
    ("rms_norm", "bf16"): _impls(
        Impl(REFERENCE, None, "torch F.rms_norm", fit_for_gpu=True),
        Impl("cute", "cute", "quack RMSNorm forward + backward", check="gem_lp.norm.selfchecks:rms_norm_cute")),
    ("rms_norm_quantize", "mxfp8"): _impls(
        _REF, Impl("cute", "cute", "CuTe RMSNorm + MX cast", check="gem_lp.norm.selfchecks:norm_cast_cute"),
        Impl("triton", "triton", "Triton RMSNorm + MX cast", check="gem_lp.norm.selfchecks:norm_cast_triton")),
    ("rms_norm_backward", "fp32"): _impls(
        _REF, Impl("cute", "cute", "quack RMSNorm backward", check="gem_lp.norm.selfchecks:backward_cute"),
        Impl("triton", "triton", "Triton RMSNorm backward", check="gem_lp.norm.selfchecks:backward_triton")),
    ("linear", "mxfp8"): _impls(
        _REF,
        Impl("cublas", "triton", "MX-exact BF16 operands (Triton/CuTe casts) into cuBLAS BF16 GEMMs",
             check="gem_lp.linear.selfchecks:cublas"),
        Impl("scaled_mm", "triton", "MX payloads + blocked scales into cuBLAS block-scaled GEMMs (torch._scaled_mm)",
             check="gem_lp.linear.selfchecks:scaled_mm")),
    ("linear_weight_grad", "mxfp8"): _impls(
        Impl(REFERENCE, None, "cublas route: dequantize pass of the saved payload + cuBLAS BF16 GEMM (scaled_mm "
             "reads the payload itself)", fit_for_gpu=True),
        Impl("cute", "cute", "CuTe MX GEMM: the saved payload decoded in registers, tokens split over CTAs",
             check="gem_lp.linear.selfchecks:weight_grad_cute")),
    ("attention", "fp32"): _impls(_REF_HOST_SYNC),
    ("attention", "bf16"): _impls(
        _REF_HOST_SYNC, Impl("fa4", "cute", "FlashAttention-4 varlen kernels", check="gem_lp.attention.selfchecks:fa4")),
    ("attention", "mxfp8"): _impls(
        _REF_HOST_SYNC,
        Impl("cute_sm90", "cute", "producer pass + FA4 Hopper kernels with the MXFP8 recipe",
             check="gem_lp.attention.selfchecks:mxfp8_sm90"),
        Impl("cute_sm100", "cute", "zero-gather MX producer + block-scaled Blackwell kernels",
             check="gem_lp.attention.selfchecks:mxfp8_sm100", cpu_model=True)),
}

_TRITON_EVERYWHERE = {"sm_90": ("triton",), "sm_100": ("triton",), "cuda": ("triton",)}
TABLE: dict[tuple[str, str], dict[str, tuple[str, ...]]] = {
    ("quantize", "mxfp8"): _TRITON_EVERYWHERE,
    ("quantize_dual", "mxfp8"): {"sm_90": ("cute", "triton"), "sm_100": ("cute", "triton"), "cuda": ("triton",)},
    ("quantize_jagged", "mxfp8"): _TRITON_EVERYWHERE,
    ("rms_norm", "bf16"): {"sm_90": ("cute",), "sm_100": ("cute",)},
    ("rms_norm_quantize", "mxfp8"): {"sm_90": ("cute", "triton"), "sm_100": ("cute", "triton"), "cuda": ("triton",)},
    ("rms_norm_backward", "fp32"): {"sm_90": ("cute", "triton"), "sm_100": ("cute", "triton"), "cuda": ("triton",)},
    ("linear", "mxfp8"): {"sm_90": ("cublas",), "sm_100": ("scaled_mm", "cublas"), "cuda": ("cublas",)},
    ("linear_weight_grad", "mxfp8"): {"sm_90": ("cute",)},
    ("attention", "fp32"): {},
    ("attention", "bf16"): {"sm_90": ("fa4",), "sm_100": ("fa4",)},
    ("attention", "mxfp8"): {"sm_90": ("cute_sm90",), "sm_100": ("cute_sm100",)},
}
assert TABLE.keys() == IMPLS.keys()


def arch_of(device: torch.device) -> str:
    """The table's architecture of a device: `cpu`, `sm_90`, `sm_100` (compute capability 10.x), or `cuda`."""
    if device.type != "cuda":
        return "cpu"
    major, _ = capability(device)
    return {9: "sm_90", 10: "sm_100"}.get(major, "cuda")


@dataclasses.dataclass(frozen=True)
class Choice:
    """One line of a plan: `impl` for (op, precision) on `arch`, and why a better one was not taken ("" when the
    first choice was)."""

    op: str
    precision: str
    arch: str
    impl: str
    why: str = ""

    def line(self) -> str:
        what = IMPLS[(self.op, self.precision)][self.impl].summary
        why = f"  [{self.why}]" if self.why else ""
        return f"{self.op:17s} {self.precision:5s} {self.arch:6s} {self.impl:10s} {what}{why}"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _toolchain_missing(toolchain: str | None) -> str | None:
    if toolchain == "triton":
        return triton_missing()
    if toolchain == "cute":
        return cute_stack_missing()
    return None


# Self-check verdicts (`selfcheck.Verdict`) consulted by the plans: impl key -> verdict, filled by the self-check.
_VERDICTS: dict[str, object] = {}


def impl_key(op: str, precision: str, impl: str, arch: str) -> str:
    return f"{op}/{precision}/{impl}/{arch}"


def plan_choice(op: str, precision: str, arch: str, *, hidden: frozenset[str] = frozenset(),
                verify_device: torch.device | None = None, emulated: bool = False) -> Choice:
    """The choice of `arch`'s plan for (op, precision): the first implementation of the table whose toolchain is
    installed (and not in `hidden`) and whose self-check did not fail; else the reference, saying why.
    `verify_device`: a CUDA device on which implementations not yet verified are self-checked first. `emulated`:
    the plan runs on CPU tensors (`emulate`), each kernel as its CPU model: the Triton kernels' (casts, producers,
    the norm backward) are the references they equal byte for byte; CuTe implementations need one of their own."""
    reasons = []
    order = TABLE[(op, precision)].get(arch, ())
    for name in order:
        impl = IMPLS[(op, precision)][name]
        missing = (f"{impl.toolchain} not available" if impl.toolchain in hidden
                   else _toolchain_missing(impl.toolchain))
        if emulated and missing is None and impl.toolchain == "cute" and not impl.cpu_model:
            missing = "no CPU model of its kernels"
        if missing:
            reasons.append(f"{name}: {missing}")
            continue
        failed = _failed_check(op, precision, name, arch, impl, verify_device)
        if failed:
            reasons.append(f"{name}: {failed}")
            continue
        return Choice(op, precision, arch, name, "; ".join(reasons))
    if not order:
        reasons.append(f"no kernel for {arch}" if arch != "cpu" else "CPU")
    return Choice(op, precision, arch, REFERENCE, "; ".join(reasons))


def _failed_check(op, precision, name, arch, impl: Impl, device) -> str | None:
    """Why the self-check rules `name` out on this device (None when it passed, is not needed or is not run)."""
    if impl.check is None:
        return None
    key = impl_key(op, precision, name, arch)
    verdict = _VERDICTS.get(key)
    if verdict is None and device is not None:
        from gem_lp.runtime import selfcheck

        verdict = _VERDICTS[key] = selfcheck.verdict(op, precision, name, impl, device)
    if verdict is None:
        return None
    return None if verdict.passed else f"self-check failed: {verdict.summary}"


def plan(arch: str, *, hidden: frozenset[str] = frozenset()) -> list[Choice]:
    """Every op's choice on `arch` from what is installed (and the verdicts known so far); nothing is run."""
    return [plan_choice(op, precision, arch, hidden=hidden) for op, precision in TABLE]


# --------------------------------------------------------------------------- choosing at call time

_CHOSEN: dict[tuple, Choice] = {}
_WARNED: set[tuple[str, str, str, str]] = set()
_EMULATED: list[str] = []


@contextlib.contextmanager
def emulate(arch: str):
    """Within this context, ops on CPU tensors take `arch`'s plan, each kernel replaced by its CPU model (the
    implementations ask `emulated_arch()`): how the Blackwell path runs end to end on a machine without one."""
    if arch not in ("sm_90", "sm_100"):
        raise ValueError(f"arch must be 'sm_90' or 'sm_100', got {arch!r}")
    _EMULATED.append(arch)
    _CHOSEN.clear()
    try:
        yield
    finally:
        _EMULATED.pop()
        _CHOSEN.clear()


def emulated_arch() -> str | None:
    """The arch whose plan CPU tensors take with CPU models of its kernels (see `emulate`), or None."""
    return _EMULATED[-1] if _EMULATED else None


def _device_arch(device: torch.device) -> str:
    if device.type != "cuda" and _EMULATED:
        return _EMULATED[-1]
    return arch_of(device)


def choose(op: str, precision: str, device: torch.device, backend: str = "auto") -> str:
    """The implementation (op, precision) takes for tensors on `device`, given the caller's `backend`:

    * `auto`: the plan's choice (first use on a GPU runs the implementation's self-check if it has not been verified
      on this device);
    * `reference`: the reference;
    * `triton` / `cute`: the plan's first implementation on that toolchain, ignoring the self-check (explicit
      choices are for tests and benchmarks); a clear error when the op has none here.
    """
    key = (op, precision, device, backend)
    choice = _CHOSEN.get(key)
    if choice is None:
        choice = _CHOSEN[key] = _resolve(op, precision, device, backend)
    return choice.impl


def _resolve(op: str, precision: str, device: torch.device, backend: str) -> Choice:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if (op, precision) not in TABLE:
        raise ValueError(f"no table entry for op {op!r} at precision {precision!r}")
    arch = _device_arch(device)
    if backend == REFERENCE:
        return Choice(op, precision, arch, REFERENCE, "backend='reference'")
    if backend == "auto":
        on_gpu = device.type == "cuda"
        choice = plan_choice(op, precision, arch, verify_device=device if on_gpu else None,
                             emulated=not on_gpu and arch != "cpu")
        if on_gpu and choice.impl == REFERENCE and not IMPLS[(op, precision)][REFERENCE].fit_for_gpu \
                and any(TABLE[(op, precision)].values()):
            _warn_reference(choice)
        return choice
    # an explicit toolchain
    impls = IMPLS[(op, precision)]
    if device.type != "cuda" and not _EMULATED:
        if backend == "triton" and interpreter_enabled():  # Triton's interpreter runs its kernels on CPU tensors
            names = [n for n, i in impls.items() if i.toolchain == "triton"][:1]
            arch = "cpu"
        else:
            hint = ("; on a CPU machine set TRITON_INTERPRET=1 before importing gem_lp to run the Triton kernels in "
                    "its interpreter" if backend == "triton" else "")
            raise ValueError(f"backend={backend!r} cannot run {op}: it needs CUDA tensors, got {device}{hint}")
    else:
        names = [n for n in TABLE[(op, precision)].get(arch, ()) if impls[n].toolchain == backend]
    if not names:
        have = sorted({i.toolchain for i in impls.values() if i.toolchain})
        raise ValueError(f"backend={backend!r} is not available for {op} ({precision}) on {arch} (it has: "
                         f"reference{''.join(', ' + t for t in have)})")
    missing = _toolchain_missing(backend)
    if missing is not None:
        raise ValueError(f"backend={backend!r} cannot run {op}: {missing}")
    return Choice(op, precision, arch, names[0], f"backend={backend!r}")


def _warn_reference(choice: Choice) -> None:
    warn_once(choice.op, choice.precision, None, f"runs the plain-PyTorch reference on {choice.arch}: "
              f"{choice.why or 'no kernel'}", arch=choice.arch)


def warn_once(op: str, precision: str, device: torch.device | None, what: str, arch: str | None = None) -> None:
    """One warning per process for (op, precision, arch, what): an op that does not run as the plan says."""
    arch = arch or _device_arch(device)
    key = (op, precision, arch, what)
    if key in _WARNED:
        return
    _WARNED.add(key)
    msg = f"gem_lp: {op} ({precision}) on {arch} {what}"
    log.warning(msg)
    warnings.warn(msg, stacklevel=4)


def choice(op: str, precision: str, device: torch.device, backend: str = "auto") -> Choice:
    """The full `Choice` (implementation and why) `choose` made for these arguments."""
    choose(op, precision, device, backend)
    return _CHOSEN[(op, precision, device, backend)]


def kernel_plan(ops, device: torch.device, backend: str = "auto") -> list[dict]:
    """The choices of `ops` ((op, precision) pairs) on `device` as a caller records them: implementation, why, the
    self-check verdict, whether a CUDA graph can capture it. Resolving them runs the self-checks not yet run."""
    arch = _device_arch(device)
    out = []
    for op, precision in ops:
        c = choice(op, precision, device, backend)
        impl = IMPLS[(op, precision)][c.impl]
        verdict = _VERDICTS.get(impl_key(op, precision, c.impl, arch))
        out.append({**c.as_dict(), "summary": impl.summary, "capture_safe": impl.capture_safe,
                    "self_check": None if verdict is None else verdict.summary})
    return out


def entry(spec: str):
    """The object a `module:attribute` string names (implementations one op uses of another, through the table)."""
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def clear() -> None:
    """Forget the choices made so far (a test that changes what is installed or verified)."""
    _CHOSEN.clear()
    _WARNED.clear()
