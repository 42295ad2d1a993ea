"""The first-use self-check machinery (verdict cache, child process, time limit, disabled checks) on the CPU with
the GPU faked, and `python -m gem_lp.selfcheck` itself on a GPU."""
import json
import subprocess
import sys

import pytest
import torch

from gem_lp.runtime import dispatch, selfcheck

GPU = torch.device("cuda", 0)
IMPL = dispatch.IMPLS[("quantize_dual", "mxfp8")]["cute"]


class _Children(list):
    """The child processes started, and what the next one returns (`outcome`)."""


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """A fingerprint without a GPU, the cache in a temporary dir, and the child process replaced by `children`."""
    monkeypatch.setattr(selfcheck, "fingerprint", lambda index: {"gpu": "Fake GPU", "driver": "1", "gem_lp": "x"})
    monkeypatch.setattr(dispatch, "arch_of", lambda device: "sm_90")
    monkeypatch.setenv(selfcheck.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(selfcheck.ENABLE_ENV, "on")
    selfcheck.clear()
    dispatch.clear()
    dispatch._VERDICTS.clear()
    children = _Children()

    def run(cmd, **kwargs):
        children.append((cmd, kwargs))
        return children.outcome(cmd, kwargs)

    children.outcome = lambda cmd, kwargs: subprocess.CompletedProcess(
        cmd, 0, json.dumps({"passed": True, "summary": "24 cases, every byte equal", "details": {}}) + "\n", "")
    monkeypatch.setattr(selfcheck.subprocess, "run", run)
    yield children
    selfcheck.clear()
    dispatch.clear()
    dispatch._VERDICTS.clear()


def test_a_verdict_is_checked_once_and_cached_on_disk(fake_gpu, tmp_path):
    v = selfcheck.verdict("quantize_dual", "mxfp8", "cute", IMPL, GPU)
    assert v.passed and v.checked and v.summary == "24 cases, every byte equal"
    (cmd, kwargs), = fake_gpu
    assert cmd[1:] == ["-m", "gem_lp.selfcheck", "--run", "quantize_dual/mxfp8/cute/sm_90", "--device", "cuda:0",
                       "--json"]
    assert kwargs["env"][selfcheck.ENABLE_ENV] == "off" and kwargs["timeout"] == selfcheck.DEFAULT_TIMEOUT_S
    selfcheck.verdict("quantize_dual", "mxfp8", "cute", IMPL, GPU)
    assert len(fake_gpu) == 1  # this process remembers it
    selfcheck.clear()
    assert selfcheck.verdict("quantize_dual", "mxfp8", "cute", IMPL, GPU).passed
    assert len(fake_gpu) == 1  # a new process reads the disk cache
    (cache,) = tmp_path.iterdir()
    stored = json.loads(cache.read_text())
    assert stored["fingerprint"]["gpu"] == "Fake GPU" and "quantize_dual/mxfp8/cute/sm_90" in stored["verdicts"]


def test_a_failed_or_hung_check_warns_and_the_plan_moves_on(fake_gpu):
    passing = fake_gpu.outcome
    fake_gpu.outcome = lambda cmd, kwargs: (subprocess.CompletedProcess(cmd, 1, "", "Traceback\nRuntimeError: boom")
                                            if "/cute/" in cmd[4] else passing(cmd, kwargs))
    with pytest.warns(UserWarning, match="the self-check of quantize_dual/mxfp8/cute/sm_90 failed on Fake GPU"):
        c = dispatch.plan_choice("quantize_dual", "mxfp8", "sm_90", verify_device=GPU)
    assert c.impl == "triton" and "exited with 1: Traceback | RuntimeError: boom" in c.why

    def hang(cmd, kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])

    fake_gpu.outcome = hang
    with pytest.warns(UserWarning, match="timed out after 600 s"):
        v = selfcheck.verdict("rms_norm_quantize", "mxfp8", "cute",
                              dispatch.IMPLS[("rms_norm_quantize", "mxfp8")]["cute"], GPU)
    assert not v.passed


def test_checks_off(fake_gpu, monkeypatch):
    monkeypatch.setenv(selfcheck.ENABLE_ENV, "off")
    v = selfcheck.verdict("quantize_dual", "mxfp8", "cute", IMPL, GPU)
    assert v.passed and not v.checked and "unchecked" in v.summary and not fake_gpu


def test_no_verdict_off_a_gpu():
    assert selfcheck.verdict("quantize_dual", "mxfp8", "cute", IMPL, torch.device("cpu")) is None


def test_plan_command_on_the_cpu():
    done = subprocess.run([sys.executable, "-m", "gem_lp.selfcheck", "--plan", "--arch", "sm_100"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "attention         mxfp8 sm_100 cute_sm100" in done.stdout
    assert "linear            mxfp8 sm_100 scaled_mm" in done.stdout


@pytest.mark.gpu
def test_selfcheck_command_passes_on_this_gpu(tmp_path):
    """Every kernel of this GPU's plan passes its check: the command a new GPU's owner runs first."""
    done = subprocess.run([sys.executable, "-m", "gem_lp.selfcheck"], capture_output=True, text=True, timeout=900)
    print(done.stdout[-6000:])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "selfcheck: 0 failed" in done.stdout
