"""Training on several processes: torchrun with two gloo processes against one process (the same global batch),
exact resume of a sharded run, a killed rank ending the job, and the pieces in-process (the launcher's environment,
sharding choices, sharded checkpoint checks, a one-rank process group: torchrun --nproc_per_node=1's path)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gem_lp.data import SyntheticDataConfig
from gem_lp.models import GemRanker
from gem_lp.train import CheckpointError, ConfigError, NonFiniteError, Trainer, TrainerConfig
from gem_lp.train.checkpoint import remove_stale_shards, shards_dir, verify_shards
from gem_lp.train.cli import CheckConfig, check_config
from gem_lp.train.distributed import LaunchEnv, LaunchError, launch_env
from gem_lp.train.sharding import fbgemm_has_kernels_for, sharding_choices

from train_helpers import TINY, TRAIN_PY, cli_env, compose_config

STEPS = ["trainer.max_steps=8", "trainer.eval_every=4", "trainer.checkpoint_every=4", "trainer.warmup_steps=2"]
FP32 = [*TINY, *STEPS, "model.precision=fp32"]
# Table-wise, row-wise (the item table of the EmbeddingCollection) and column-wise (a pooled table) in one run: the
# sharded types TorchRec offers on the CPU.
MIXED = ["trainer.sharding=table_wise", "+trainer.table_sharding.item=row_wise",
         "+trainer.table_sharding.pooled_user_segment=column_wise"]
TABLES = GemRanker.embedding_tables(SyntheticDataConfig().feature_spec())  # the synthetic data's (TINY's too)


def torchrun(*args, cwd, nproc=2, timeout=240, check=True) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=<nproc> train.py <args>` (a free port each time)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(TRAIN_PY), *map(str, args)]
    proc = subprocess.run(command, cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc


def metrics_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def assert_close_runs(one: dict, many: dict, tolerance: float) -> None:
    """Per-step losses and every eval point of two runs agree within `tolerance` (absolute)."""
    assert len(one["train_loss_history"]) == len(many["train_loss_history"])
    assert max(abs(a - b) for a, b in zip(one["train_loss_history"], many["train_loss_history"])) <= tolerance
    for a, b in zip(one["eval_history"], many["eval_history"], strict=True):
        assert a["step"] == b["step"]
        for key in ("eval_loss", "eval_auc", "eval_ne"):
            assert b[key] == pytest.approx(a[key], abs=tolerance), key


# ---- two processes through torchrun ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp32_single(tmp_path_factory):
    """The reference: one process, the same config and global batch."""
    return Trainer(compose_config(*FP32), tmp_path_factory.mktemp("single")).fit()


def test_two_processes_match_one_process_and_resume_exactly(fp32_single, tmp_path):
    """Two processes, tables table-wise, row-wise and column-wise: the same losses and eval metrics as one process
    (float32 reduction order only); rank 0 writes the run's files; a run stopped at step 4 and resumed repeats the
    uninterrupted run exactly. (One test: its three torchrun runs are shared by the checks.)"""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    torchrun(*FP32, *MIXED, f"hydra.run.dir={whole}", cwd=tmp_path)
    stopped = torchrun(*FP32, *MIXED, f"hydra.run.dir={resumed}", "trainer.stop_after=4", cwd=tmp_path)
    torchrun(*FP32, *MIXED, f"hydra.run.dir={resumed}", "resume=true", cwd=tmp_path)

    metrics = metrics_of(whole)
    assert_close_runs(fp32_single, metrics, tolerance=1e-5)
    assert metrics["world_size"] == 2 and metrics["batch_size"] == 16
    plan = metrics["sharding_plan"]
    assert set(plan) == set(TABLES["sequence_embeddings"]) | set(TABLES["pooled_embeddings"])
    assert plan["item"]["sharding_type"] == "row_wise" and plan["item"]["ranks"] == [0, 1]
    assert plan["pooled_user_segment"]["sharding_type"] == "column_wise"
    assert {plan[t]["sharding_type"] for t in plan if t not in ("item", "pooled_user_segment")} == {"table_wise"}
    assert all(len(plan[t]["ranks"]) == 1 for t in plan if plan[t]["sharding_type"] == "table_wise")
    assert {p["compute_kernel"] for p in plan.values()} == {"fused"}

    log = (whole / "train.log").read_text()
    assert log.count("done: 8 steps") == 1 and log.count("step 8: eval") == 1 and "[rank 1]" not in log
    assert (whole / ".hydra" / "config.yaml").is_file() and (whole / "checkpoint.pt").is_file()
    (shards,) = shards_dir(whole / "checkpoint.pt").iterdir()  # the last save's only: the earlier one is gone
    assert shards.name.startswith("step_00000008.")
    assert sorted(f.name for f in shards.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]

    assert "done: 4 steps" in stopped.stdout + stopped.stderr
    again = metrics_of(resumed)
    assert again["train_loss_history"] == metrics["train_loss_history"]
    assert again["eval_history"] == metrics["eval_history"]
    assert [r["step"] for r in again["resumes"]] == [4]


def test_data_parallel_tables_match_one_process_and_share_one_run_directory(fp32_single, tmp_path):
    """trainer.sharding=data_parallel (the GPU host's choice): plain TorchRec modules under DDP. Without
    hydra.run.dir every rank takes rank 0's `outputs/<date>/<time>`."""
    torchrun(*FP32, "trainer.sharding=data_parallel", cwd=tmp_path)
    (run_dir,) = (tmp_path / "outputs").glob("*/*")
    metrics = metrics_of(run_dir)
    assert_close_runs(fp32_single, metrics, tolerance=1e-5)
    assert {(p["sharding_type"], tuple(p["ranks"])) for p in metrics["sharding_plan"].values()} == {
        ("data_parallel", (0, 1))}


@pytest.mark.parametrize("model", ["gem_bf16", "gem_mxfp8"])
def test_low_precision_recipes_on_two_processes(tmp_path, model):
    """BF16 and MXFP8 train on two ranks. Their rounding depends on the batch split (MX blocks along the batch
    dimension hold other samples, the GEMMs other shapes), so they agree with one process to about 1e-3, not to
    float32 rounding."""
    config = [*TINY, *STEPS, f"model={model}"]
    one = Trainer(compose_config(*config), tmp_path / "one").fit()
    torchrun(*config, f"hydra.run.dir={tmp_path / 'two'}", cwd=tmp_path)
    two = metrics_of(tmp_path / "two")
    assert two["precision"] == model[4:] and two["world_size"] == 2
    assert torch.isfinite(torch.tensor(two["train_loss_history"])).all()
    assert_close_runs({**one, "eval_history": []}, {**two, "eval_history": []}, tolerance=2e-2)
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], abs=2e-2)


def _worker_of_rank(launcher_pid: int, rank: int) -> int | None:
    """The pid of torchrun's worker process of `rank` (its environment says RANK=<rank>)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if parent == launcher_pid and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the worker processes through /proc")
def test_a_killed_rank_ends_the_job_with_an_error(tmp_path):
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(TRAIN_PY),
               *TINY, "trainer.max_steps=100000", "trainer.log_every=1", "trainer.eval_every=100000",
               "trainer.checkpoint_every=100000", f"hydra.run.dir={run_dir}"]
    launcher = subprocess.Popen(command, cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while not ((run_dir / "train.log").is_file() and "step 3/" in (run_dir / "train.log").read_text()):
            assert launcher.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        victim = _worker_of_rank(launcher.pid, rank=1)
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        output, _ = launcher.communicate(timeout=60)  # a hang would raise TimeoutExpired here
        assert time.monotonic() - killed < 60
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode != 0
    assert f"Signal 9 (SIGKILL) received by PID {victim}" in output  # torchrun's summary names the killed rank
    assert not (run_dir / "metrics.json").exists()


# ---- one rank in this process: torchrun --nproc_per_node=1's code path ------------------------------------------


@pytest.fixture
def one_rank(monkeypatch):
    """torchrun's environment for one process (a gloo group of one on a free port)."""
    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT="0").items():
        monkeypatch.setenv(name, value)


def fit_and_close(trainer: Trainer) -> dict:
    try:
        return trainer.fit()
    finally:
        trainer.close()


@pytest.mark.parametrize("sharding", ["data_parallel", "table_wise"])
def test_one_rank_matches_one_process_and_resumes_exactly(fp32_single, one_rank, tmp_path, sharding):
    whole = fit_and_close(Trainer(compose_config(*FP32, f"trainer.sharding={sharding}"), tmp_path / "whole"))
    assert_close_runs(fp32_single, whole, tolerance=1e-6)
    assert whole["world_size"] == 1 and whole["sharding_plan"]["item"]["ranks"] == [0]
    fit_and_close(Trainer(compose_config(*FP32, f"trainer.sharding={sharding}", "trainer.stop_after=4"),
                          tmp_path / "resumed"))
    resumed = fit_and_close(Trainer(compose_config(*FP32, f"trainer.sharding={sharding}", "resume=true"),
                                    tmp_path / "resumed"))
    assert resumed["train_loss_history"] == whole["train_loss_history"]
    assert resumed["eval_history"] == whole["eval_history"]


@pytest.fixture
def stopped_one_rank(one_rank, tmp_path):
    """A one-rank table-wise run stopped at step 4 (a sharded checkpoint)."""
    fit_and_close(Trainer(compose_config(*FP32, "trainer.sharding=table_wise", "trainer.stop_after=4"), tmp_path))
    return tmp_path


def test_a_corrupt_or_missing_shard_is_refused(stopped_one_rank):
    config = compose_config(*FP32, "trainer.sharding=table_wise", "resume=true")
    (shards,) = shards_dir(stopped_one_rank / "checkpoint.pt").iterdir()
    data = (shards / "__0_0.distcp").read_bytes()
    (shards / "__0_0.distcp").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CheckpointError, match=f"{shards / '__0_0.distcp'} is corrupt"):
        Trainer(config, stopped_one_rank)
    (shards / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"holds \['.metadata'\], the checkpoint lists"):
        Trainer(config, stopped_one_rank)
    for entry in shards.iterdir():
        entry.unlink()
    shards.rmdir()
    with pytest.raises(CheckpointError, match="its sharded state .* is missing"):
        Trainer(config, stopped_one_rank)


def test_a_sharded_checkpoint_resumes_only_with_its_plan_and_under_torchrun(stopped_one_rank, monkeypatch):
    with pytest.raises(ConfigError, match=r"sharding plan differs from the checkpoint's \(plan.action.compute_kernel: "
                                          r"'fused' in the checkpoint, 'unsharded module \(DDP\)' now"):
        Trainer(compose_config(*FP32, "trainer.sharding=data_parallel", "resume=true"), stopped_one_rank)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name)
    with pytest.raises(ConfigError, match=r"was written by torchrun \(1 process\(es\)\); resume it with torchrun"):
        Trainer(compose_config(*FP32, "resume=true"), stopped_one_rank)


def test_resumed_fused_tables_follow_the_stretched_schedule(stopped_one_rank):
    """resume=true with a new max_steps recomputes the LR of TorchRec's fused optimizer as of the dense one."""
    from gem_lp.train.optim import warmup_decay_lambda

    trainer = Trainer(compose_config(*FP32, "trainer.sharding=table_wise", "resume=true", "trainer.max_steps=12"),
                      stopped_one_rank)
    try:
        assert trainer.fused_tables
        expected = 0.05 * warmup_decay_lambda(2, 12, "cosine", 0.1)(4)
        assert [g["lr"] for g in trainer.embedding_optimizer.param_groups] == pytest.approx(
            [expected] * len(trainer.embedding_optimizer.param_groups))
        assert trainer.fit()["steps"] == 12
    finally:
        trainer.close()


def test_a_single_process_checkpoint_is_not_resumed_under_torchrun(tmp_path, monkeypatch):
    Trainer(compose_config(*FP32, "trainer.stop_after=4"), tmp_path).fit()
    for name, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT="0").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match="written by a single process \\(no torchrun\\); resume it without"):
        Trainer(compose_config(*FP32, "resume=true"), tmp_path)


def test_leftover_shard_directories_are_removed(stopped_one_rank, caplog):
    root = shards_dir(stopped_one_rank / "checkpoint.pt")
    (kept,) = root.iterdir()
    (root / ".step_00000006.0badf00d.tmp").mkdir()  # a save killed mid-write
    (root / "step_00000006.0badf00d").mkdir()  # a save whose checkpoint file was never written
    (root / "notes").mkdir()  # not ours: left alone
    trainer = Trainer(compose_config(*FP32, "trainer.sharding=table_wise", "resume=true"), stopped_one_rank)
    trainer.close()
    assert sorted(p.name for p in root.iterdir()) == sorted([kept.name, "notes"])
    assert "sharded state that no checkpoint file names" in caplog.text
    assert remove_stale_shards(stopped_one_rank / "checkpoint.pt", keep=kept.name) == []


def test_verify_shards_names_what_is_wrong(tmp_path):
    directory = shards_dir(tmp_path / "ckpt.pt") / "step_00000001.aa"
    directory.mkdir(parents=True)
    (directory / "a").write_bytes(b"x")
    record = {"dir": directory.name, "sha256": {"a": "2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881"}}
    assert verify_shards(tmp_path / "ckpt.pt", record) is None
    (directory / "a").write_bytes(b"y")
    assert "is corrupt" in verify_shards(tmp_path / "ckpt.pt", record)
    (directory / "b").write_bytes(b"")
    assert "holds ['a', 'b'], the checkpoint lists ['a']" in verify_shards(tmp_path / "ckpt.pt", record)


def test_a_non_finite_gradient_on_another_rank_stops_this_one(one_rank, tmp_path):
    """The per-step all-reduce carries each rank's non-finite flag and stop signal: a flag from another rank stops
    this rank before its optimizer step, a signal that another rank received stops it at the next step boundary.
    (The other rank's slots are added by a stand-in for the all-reduce.)"""
    trainer = Trainer(compose_config(*FP32, "trainer.sharding=table_wise"), tmp_path)
    try:
        real_sum, other_rank = trainer.group.sum, {}

        def sum_with_a_second_rank(slots):  # slots of two ranks: [loss, bad 0, bad 1, signal 0, signal 1]
            total = real_sum(slots)
            total[2] += other_rank.get("bad", 0.0)
            total[4] += other_rank.get("signal", 0.0)
            return total

        trainer.group.sum = sum_with_a_second_rank
        trainer.world_size = 2  # the slot layout of two ranks; this rank keeps its whole batch
        batch = trainer.source.train_dataset(0).batch(0)
        other_rank["signal"] = float(signal.SIGTERM)
        trainer.train_step(batch, 1, 2 * batch.batch_size)
        assert trainer._agreed_stop == signal.SIGTERM
        other_rank.update(bad=1.0, signal=0.0)
        before = {k: v.clone() for k, v in trainer.model.state_dict().items() if "embeddings" not in k}
        with pytest.raises(NonFiniteError, match=r"step 2: rank\(s\) \[1\] found a non-finite training loss or "
                                                 r"gradient; every rank stops before the optimizer step") as info:
            trainer.train_step(batch, 2, 2 * batch.batch_size)
        assert info.value.tensors == ["rank 1"] and trainer._agreed_stop is None
        after = trainer.model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)  # no dense update followed
    finally:
        trainer.close()


# ---- the launcher's environment, sharding choices, command-line checks ------------------------------------------


def test_launch_env_reads_torchrun_variables():
    assert launch_env({}) is None
    env = dict(RANK="1", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="h", MASTER_PORT="1")
    assert launch_env(env) == LaunchEnv(rank=1, world_size=4, local_rank=1, local_world_size=2)
    assert launch_env({**env, "LOCAL_WORLD_SIZE": "4"}).local_world_size == 4
    with pytest.raises(LaunchError, match="sets RANK but not WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT"):
        launch_env({"RANK": "0"})
    with pytest.raises(LaunchError, match="RANK=4: expected 0 <= RANK < WORLD_SIZE=4"):
        launch_env({**env, "RANK": "4"})
    with pytest.raises(LaunchError, match="WORLD_SIZE='two': expected an integer"):
        launch_env({**env, "WORLD_SIZE": "two"})
    with pytest.raises(LaunchError, match="LOCAL_RANK=2, LOCAL_WORLD_SIZE=2"):
        launch_env({**env, "LOCAL_RANK": "2"})


def test_sharding_choices_on_the_cpu():
    def choices(**settings):
        return sharding_choices(TrainerConfig(**settings), TABLES, "cpu")

    auto = choices()
    assert auto["item"] == ["table_wise", "row_wise", "column_wise"]  # an EmbeddingCollection table
    assert auto["pooled_user_segment"] == ["table_wise", "column_wise"]  # EmbeddingBagCollection: no row-wise on CPU
    assert choices(sharding="data_parallel") == {}
    assert all(types == ["column_wise"] for types in choices(sharding="column_wise").values())
    mixed = choices(sharding="table_wise", table_sharding={"item": "row_wise"})
    assert mixed["item"] == ["row_wise"] and mixed["action"] == ["table_wise"]
    with pytest.raises(ConfigError, match="trainer.sharding=row_wise: TorchRec shards the EmbeddingBagCollection "
                                          "table 'pooled_user_segment' on cpu as table_wise / column_wise only"):
        choices(sharding="row_wise")
    with pytest.raises(ConfigError, match=r"trainer.table_sharding: unknown table\(s\) \['items'\]"):
        choices(table_sharding={"items": "row_wise"})
    with pytest.raises(ConfigError, match="data_parallel keeps every table whole on every rank"):
        choices(sharding="data_parallel", table_sharding={"item": "row_wise"})


def test_sharding_where_fbgemm_has_no_kernels(monkeypatch):
    """The GPU host's fbgemm-gpu is the CPU build: `auto` keeps the tables data parallel, a sharded type is refused."""
    assert fbgemm_has_kernels_for("cpu")
    if not torch.cuda.is_available():
        assert not fbgemm_has_kernels_for("cuda")  # this machine's fbgemm-gpu-cpu
    monkeypatch.setattr("gem_lp.train.sharding.fbgemm_has_kernels_for", lambda device_type: device_type == "cpu")
    assert sharding_choices(TrainerConfig(), TABLES, "cuda") == {}
    with pytest.raises(ConfigError, match="sharded tables run fbgemm's kernels, which this fbgemm-gpu build lacks for "
                                          "cuda .*use trainer.sharding=data_parallel"):
        sharding_choices(TrainerConfig(sharding="table_wise"), TABLES, "cuda")


def test_trainer_config_checks_the_distributed_keys():
    with pytest.raises(ValueError, match="trainer.sharding must be one of"):
        TrainerConfig(sharding="rows")
    with pytest.raises(ValueError, match="trainer.table_sharding.item must be one of"):
        TrainerConfig(table_sharding={"item": "data_parallel"})
    with pytest.raises(ValueError, match="trainer.dist_timeout_s must be a finite number of seconds > 0"):
        TrainerConfig(dist_timeout_s=0)


def test_the_command_line_checks_the_run_against_the_number_of_processes(monkeypatch):
    from gem_lp.train.cli import RunRefused

    launch = LaunchEnv(rank=0, world_size=4, local_rank=0, local_world_size=4)
    with pytest.raises(RunRefused, match="data.batch_size=2 is the global batch, split over the 4 processes"):
        check_config(compose_config(*TINY, "data.batch_size=2"), None, launch)
    with pytest.raises(RunRefused, match="trainer.sharding=row_wise: TorchRec shards the EmbeddingBagCollection"):
        check_config(compose_config(*TINY, "trainer.sharding=row_wise"), None, launch)
    check_config(compose_config(*TINY), None, launch)


def test_a_sweep_is_refused_under_torchrun(monkeypatch, capsys):
    for name, value in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT="1").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        CheckConfig().on_multirun_start(compose_config(*TINY))
    assert exit_info.value.code == 1
    assert "under torchrun, start each job with its own torchrun command" in capsys.readouterr().err
