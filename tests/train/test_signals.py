"""SIGINT / SIGTERM: a checkpoint at the next step boundary, then exit 130 / 143; the run resumes exactly."""
import signal
import subprocess
import sys

import pytest
import torch

from gem_lp.train import Trainer, TrainingInterrupted, load_checkpoint

from train_helpers import TINY, TRAIN_PY, cli_env

COMMON = ["trainer.max_steps=8", "trainer.eval_every=4", "trainer.checkpoint_every=4"]


def test_sigterm_checkpoints_at_the_step_boundary_and_resumes_exactly(tiny_config, tmp_path):
    straight = Trainer(tiny_config(*COMMON), tmp_path / "straight").fit()

    trainer = Trainer(tiny_config(*COMMON), tmp_path / "stopped")
    calls = {"n": 0}

    def signal_during_step_3(module, args):
        calls["n"] += 1
        if calls["n"] == 3:  # the third training forward: SIGTERM arrives mid-step
            handler = signal.getsignal(signal.SIGTERM)
            assert handler not in (signal.SIG_DFL, signal.SIG_IGN, None), "no SIGTERM handler while training"
            signal.raise_signal(signal.SIGTERM)

    hook = trainer.model.dense_input.register_forward_pre_hook(signal_during_step_3)
    with pytest.raises(TrainingInterrupted) as info:
        trainer.fit()
    hook.remove()
    assert info.value.exit_code == 143 and info.value.step == 3  # step 3 finished, then the stop
    assert load_checkpoint(tmp_path / "stopped" / "checkpoint.pt")["step"] == 3
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the previous handler is back

    resumed = Trainer(tiny_config(*COMMON, "resume=true"), tmp_path / "stopped").fit()
    assert resumed["train_loss_history"] == straight["train_loss_history"]
    assert resumed["eval_history"] == straight["eval_history"]
    a = load_checkpoint(tmp_path / "straight" / "checkpoint.pt")["model"]
    b = load_checkpoint(tmp_path / "stopped" / "checkpoint.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_without_checkpoints_no_file_is_written_and_a_signal_says_so(tiny_config, tmp_path):
    """`trainer.checkpoint_every=null`: the run writes no checkpoint, at its end or on a signal."""
    plain = ["trainer.max_steps=4", "trainer.eval_every=4", "trainer.checkpoint_every=null"]
    metrics = Trainer(tiny_config(*plain), tmp_path / "done").fit()
    assert metrics["steps"] == 4 and not (tmp_path / "done" / "checkpoint.pt").exists()
    trainer = Trainer(tiny_config(*plain), tmp_path / "stopped")
    hook = trainer.model.dense_input.register_forward_pre_hook(lambda *_: signal.raise_signal(signal.SIGTERM))
    with pytest.raises(TrainingInterrupted, match="no checkpoint") as info:
        trainer.fit()
    hook.remove()
    assert info.value.checkpoint is None and info.value.step == 1
    assert not (tmp_path / "stopped" / "checkpoint.pt").exists()


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_the_command_line_exits_with_128_plus_the_signal(tmp_path, signum, code):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(TRAIN_PY), f"hydra.run.dir={run_dir}", *TINY,
                             "trainer.max_steps=100000", "trainer.log_every=1", "trainer.eval_every=100000",
                             "trainer.checkpoint_every=100000"],
                            cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = []
    try:
        for line in proc.stdout:
            output.append(line)
            if line.startswith("step 2/"):
                proc.send_signal(signum)
                break
        output.append(proc.communicate(timeout=120)[0])
    finally:
        proc.kill()
    text = "".join(output)
    assert proc.returncode == code, text[-3000:]
    step = load_checkpoint(run_dir / "checkpoint.pt")["step"]
    assert step >= 2
    assert f"stopped by {signal.Signals(signum).name} at step {step}" in text
    assert "Traceback" not in text
    log = (run_dir / "train.log").read_text()
    assert "step 1/100000" in log and f"stopped by {signal.Signals(signum).name}" in log
