"""Training on Parquet logs through the shipped config (`data=parquet data.path=...`), with exact resume."""
import json
import math

import pytest
import torch

from gem_lp.train import Trainer, load_checkpoint

from train_helpers import TRAIN_PY, run_cli

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    """600 rows whose label is planted in the candidate's id and a dense feature."""
    g = torch.Generator().manual_seed(0)
    n = 600
    lengths = torch.randint(0, 12, (n,), generator=g)
    candidates = torch.randint(0, 100, (n,), generator=g)
    dense = torch.randn(n, 3, generator=g)
    logit = torch.where(candidates % 2 == 0, 1.5, -1.5) + dense[:, 0]
    labels = torch.bernoulli(torch.sigmoid(logit), generator=g)
    hist = [torch.randint(0, 100, (int(k),), generator=g).tolist() for k in lengths]
    table = pa.table({
        "clicked": labels.tolist(),
        "history": hist,
        "history_action": [[i % 3 for i in range(len(h))] for h in hist],
        "item": candidates.tolist(),
        "country": torch.randint(0, 20, (n,), generator=g).tolist(),
        "d0": dense[:, 0].tolist(), "d1": dense[:, 1].tolist(), "d2": dense[:, 2].tolist(),
    })
    path = tmp_path_factory.mktemp("logs") / "clicks.parquet"
    pq.write_table(table, path)
    return path


def overrides(path):
    return ["data=parquet", f"data.path={path}", "data.label=clicked", "data.history_item=history",
            "data.candidate_item=item", "data.num_items=100", "data.batch_size=32", "data.dense_features=[d0,d1,d2]",
            "data.event_features=[{column: history_action, num_embeddings: 3}]",
            "data.pooled_features=[{column: country, num_embeddings: 20}]",
            "trainer.max_steps=60", "trainer.eval_every=30", "trainer.eval_batches=4", "trainer.checkpoint_every=30",
            "trainer.warmup_steps=5", "trainer.lr=3e-3", "trainer.progress=false", "trainer.tensorboard=false",
            "trainer.num_threads=1", "model.mlp_hidden=64", "model.head_hidden=64"]


def test_trains_on_parquet_and_resumes_exactly(tiny_config, composed, logs, tmp_path):
    straight = Trainer(composed(*overrides(logs)), tmp_path / "straight").fit()
    assert straight["teacher_auc"] is None and straight["steps"] == 60
    assert straight["eval_auc"] > 0.7  # the planted signal is learned
    Trainer(composed(*overrides(logs), "trainer.stop_after=30"), tmp_path / "resumed").fit()
    resumed = Trainer(composed(*overrides(logs), "resume=true"), tmp_path / "resumed").fit()
    assert resumed["train_loss_history"] == straight["train_loss_history"]
    a = load_checkpoint(tmp_path / "straight" / "checkpoint.pt")["model"]
    b = load_checkpoint(tmp_path / "resumed" / "checkpoint.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert set(a) >= {"sequence_embeddings.embeddings.item.weight",
                      "sequence_embeddings.embeddings.history_action.weight",
                      "pooled_embeddings.embedding_bags.pooled_country.weight"}


def test_command_line(logs, tmp_path):
    run_dir = tmp_path / "run"
    run_cli(TRAIN_PY, f"hydra.run.dir={run_dir}", *overrides(logs), "trainer.max_steps=4", "trainer.eval_every=2",
            cwd=tmp_path)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["steps"] == 4 and metrics["teacher_auc"] is None
    bad = run_cli(TRAIN_PY, f"hydra.run.dir={tmp_path / 'bad'}", *overrides(logs), "data.num_items=50",
                  cwd=tmp_path, check=False)
    assert bad.returncode == 1
    assert f"{logs}: column 'history': row" in bad.stdout + bad.stderr and "outside [0, 50)" in bad.stdout + bad.stderr


def test_a_missing_file_is_refused_before_the_run_directory(composed, tmp_path):
    """What the command line's config check (the Hydra callback, see test_configs) says about a missing file."""
    from gem_lp.train.cli import RunRefused, check_config

    with pytest.raises(RunRefused, match=f"data.path: no Parquet file or directory at {tmp_path / 'nothing.parquet'}"):
        check_config(composed(*overrides(tmp_path / "nothing.parquet")), str(tmp_path / "run"))
    assert list(tmp_path.iterdir()) == []
    logs = tmp_path / "logs.parquet"
    logs.touch()
    with pytest.raises(RunRefused, match=f"data.eval_path {logs} is data.path {logs}: the eval rows would be trained"):
        check_config(composed(*overrides(logs), f"data.eval_path={logs}"), str(tmp_path / "run"))
    assert list(tmp_path.iterdir()) == [logs]


def test_a_data_source_of_ones_own(tmp_path):
    """Any pipeline that yields RecBatches: a source with its own keys, handed to the Trainer with a RunConfig."""
    import dataclasses

    from torch.utils.data import IterableDataset
    from torchrec import KeyedJaggedTensor

    from gem_lp.data import EmbeddingFeature, FeatureSpec, RecBatch
    from gem_lp.models import GemModelConfig
    from gem_lp.train import RunConfig, TrainerConfig

    @dataclasses.dataclass
    class ClickLogConfig:
        batch_size: int = 16

    spec = FeatureSpec(num_items=30, num_dense=2, history_key="seen", candidate_key="item",
                       pooled_features=(EmbeddingFeature("region", 5),))

    def batch(index: int, split: str) -> RecBatch:
        g = torch.Generator().manual_seed(index * 2 + (split == "eval"))
        n = torch.randint(0, 5, (16,), generator=g)
        item = torch.randint(0, 30, (16,), generator=g)
        sequence = KeyedJaggedTensor.from_lengths_sync(
            keys=["seen", "item"], values=torch.cat([torch.randint(0, 30, (int(n.sum()),), generator=g), item]),
            lengths=torch.cat([n, torch.ones(16, dtype=torch.int64)]))
        sparse = KeyedJaggedTensor.from_lengths_sync(keys=["region"], values=torch.randint(0, 5, (16,), generator=g),
                                                     lengths=torch.ones(16, dtype=torch.int64))
        return RecBatch(sparse, sequence, torch.randn(16, 2, generator=g), (item % 2).float())

    class Stream(IterableDataset):
        def __init__(self, start):
            self.start = start

        def __iter__(self):
            index = self.start
            while True:
                yield batch(index, "train")
                index += 1

    class ClickLogs:
        features = spec

        def train_dataset(self, start):
            return Stream(start)

        def eval_batches(self, limit=None):
            return [batch(i, "eval") for i in range(2 if limit is None else min(limit, 2))]

    run = RunConfig(model=GemModelConfig(embedding_dim=32, d_model=32, head_dim=32, num_blocks=1, mlp_hidden=32,
                                         dense_hidden=32, head_hidden=32),
                    data=ClickLogConfig(),
                    trainer=TrainerConfig(max_steps=6, eval_every=3, checkpoint_every=3, warmup_steps=1,
                                          progress=False, tensorboard=False, num_threads=1))
    metrics = Trainer(run, tmp_path, source=ClickLogs()).fit()
    assert metrics["steps"] == 6 and metrics["batch_size"] == 16 and metrics["teacher_auc"] is None
    assert metrics["eval_rows"] == metrics["eval_rows_total"] == 32  # counted: the source does not say
    assert metrics["data"] == {"source": "ClickLogs", "config": {"batch_size": 16}}
    with pytest.raises(TypeError, match="expected a SyntheticDataConfig or ParquetDataConfig"):
        Trainer(run, tmp_path / "no_source")


def test_a_config_of_ones_own_extends_the_shipped_parquet_config(logs, tmp_path):
    """The docs' recipe: my_configs/data/<name>.yaml starting from `parquet`, chosen with --config-dir."""
    (tmp_path / "my_configs" / "data").mkdir(parents=True)
    (tmp_path / "my_configs" / "data" / "clicks.yaml").write_text(
        "defaults:\n  - parquet\n  - _self_\n"
        f"path: {logs}\nlabel: clicked\nhistory_item: history\ncandidate_item: item\nnum_items: 100\n"
        "event_features:\n  - {column: history_action, num_embeddings: 3}\n"
        "pooled_features:\n  - {column: country, num_embeddings: 20}\ndense_features: [d0, d1, d2]\n")
    out = run_cli(TRAIN_PY, "--config-dir", tmp_path / "my_configs", "data=clicks", "--cfg", "job", cwd=tmp_path)
    assert f"path: {logs}" in out.stdout and "eval_fraction: 0.1" in out.stdout


SHORT = ["trainer.max_steps=2", "trainer.eval_every=2", "trainer.checkpoint_every=2", "trainer.warmup_steps=1"]


def test_eval_covers_every_eval_row_unless_capped(composed, logs, tmp_path, caplog):
    full = Trainer(composed(*overrides(logs), *SHORT, "trainer.eval_batches=null"), tmp_path / "full").fit()
    assert full["eval_rows"] == full["eval_rows_total"] == 60  # the last 10% of 600 rows, in batches of 32
    data = full["data"]
    assert data["source"] == "parquet" and data["paths"] == {"train": str(logs), "eval": None}
    assert data["rows"] == {"train": 540, "eval": 60} and len(data["schema_hash"]) == 16
    assert data["schema"]["history"] == "list<element: int64>"
    with caplog.at_level("INFO", logger="gem_lp"):
        capped = Trainer(composed(*overrides(logs), *SHORT, "trainer.eval_batches=1"), tmp_path / "capped").fit()
    assert capped["eval_rows"] == 32 and capped["eval_rows_total"] == 60
    assert "eval: 32 of 60 eval rows (trainer.eval_batches=1 caps it" in caplog.text


def test_no_dense_features_and_the_candidate_as_a_pooled_feature(composed, logs, tmp_path):
    metrics = Trainer(composed(*overrides(logs), *SHORT, "data.dense_features=[]",
                               "data.pooled_features=[{column: country, num_embeddings: 20}, "
                               "{column: item, num_embeddings: 100}]"), tmp_path).fit()
    assert metrics["steps"] == 2 and all(math.isfinite(x) for x in metrics["train_loss_history"])
    assert math.isfinite(metrics["eval_ne"])


def test_eval_logits_of_several_ranks_come_back_in_the_order_of_one_process():
    """Uneven eval batches (the last one short) cut over 2 ranks: the gathered logits are one process's."""
    from gem_lp.data import rank_bounds

    sizes, world = [5, 5, 3], 2
    whole = torch.arange(13, dtype=torch.float32)
    starts = [0, 5, 10]
    per_rank = [torch.cat([whole[s + a:s + b] for s, n in zip(starts, sizes)
                           for a, b in [rank_bounds(n, r, world)]]) for r in range(world)]
    longest = max(p.numel() for p in per_rank)

    class Group:
        def gather(self, mine):
            return torch.stack([torch.cat([p, p.new_zeros(longest - p.numel())]) for p in per_rank])

    trainer = Trainer.__new__(Trainer)
    trainer.world_size, trainer.group = world, Group()
    mine = [whole[s + a:s + b] for s, n in zip(starts, sizes) for a, b in [rank_bounds(n, 0, world)]]
    assert torch.equal(trainer._gathered_eval_logits(mine, sizes), whole)


def test_a_raw_log_built_into_samples_trains(composed, tmp_path):
    """The docs' walk-through at test size: a generated ratings log with side tables, build_sequences, train.py's
    config written beside the samples."""
    from gem_lp.data.build_sequences import BuildOptions, build_sequences, train_overrides
    from gem_lp.data.example_log import generate_log

    log = generate_log(tmp_path / "ratings.parquet", events=3000, users=60, items=200, side_tables=True)
    summary = build_sequences(BuildOptions(
        log=str(log), out=str(tmp_path / "built"), rating="rating", threshold=4, event_columns=("rating",),
        user_table=str(tmp_path / "ratings_users.parquet"), item_table=str(tmp_path / "ratings_items.parquet"),
        dense=("age",), item_history_columns=("genre",), max_history=20), log=lambda _: None)
    data = summary["data"]
    assert [f["column"] for f in data["pooled_features"]] == ["user", "occupation", "genre"]
    assert [f["column"] for f in data["event_features"]] == ["hist_rating", "hist_genre"]
    assert data["dense_features"] == ["age"] and summary["rows"]["events"] == 3000
    times = pq.read_table(log).column("timestamp").to_pylist()
    assert times == sorted(times)  # the generated log is in time order
    from hydra import compose, initialize_config_dir

    from train_helpers import CONFIG_DIR
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            *train_overrides(summary), "data.batch_size=64", *SHORT, "trainer.progress=false",
            "trainer.tensorboard=false", "model.mlp_hidden=64", "model.head_hidden=64"])
    metrics = Trainer(cfg, tmp_path / "run").fit()
    assert metrics["eval_rows"] == metrics["eval_rows_total"] == summary["rows"]["eval"]
    assert metrics["data"]["paths"] == {"train": data["path"], "eval": data["eval_path"]}
