"""A generated ratings log to try `build_sequences` and `data=parquet` on: `python -m gem_lp.data.example_log OUT`.

Shaped like a public movie-ratings log (by default MovieLens-100K's sizes: 943 users, 1,682 items, 100,000 ratings
over seven months; every user with at least 20 ratings, a few with hundreds): one row per rating, `user_id`, `item_id`,
`timestamp` (Unix seconds) and `rating` (1-5), in time order. Items belong to 20 genres; each user favours two of
them, picks most items there and rates those higher, so a user's history says what they will like. With
`--side-tables` it also writes a user table (`user_id`, `age`, `occupation`) and an item table (`item_id`, `genre`).
Written in chunks of events (row groups), so a log of any size needs little memory.

A rating is `clip(rint(teacher_score + noise), 1, 5)`, noise ~ N(0, 0.9), where `teacher_score` (also a column of
the log) is `3.0 + 1.2 * likes - 0.4 * (not likes) + generosity[user]` and `likes` says the item's genre is one of the
user's two favourites. P(rating >= X) rises with `teacher_score`, so no model ranks the events better: its AUC is the
best achievable. `python -m gem_lp.data.example_log --teacher-auc LOG BUILT_DIR` gives it on the eval split that
`build_sequences` wrote to BUILT_DIR (`--rating rating --threshold X`, a global time split), and beside it the AUC of
the teacher's form estimated from each sample's history alone (with the side tables): what the samples hold.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

NUM_GENRES = 20
# the teacher: BASE + LIKED (an item of a favourite genre) or BASE + DISLIKED, plus the user's generosity
# ~ N(0, GENEROSITY_SD); a rating adds noise ~ N(0, NOISE_SD)
BASE, LIKED, DISLIKED, GENEROSITY_SD, NOISE_SD = 3.0, 1.2, -0.4, 0.4, 0.9
OCCUPATIONS = ("artist", "doctor", "educator", "engineer", "homemaker", "lawyer", "programmer", "retired", "student",
               "writer")


def generate_log(path: str | Path, events: int = 100_000, users: int = 943, items: int = 1682, days: int = 215,
                 seed: int = 0, side_tables: bool = False, chunk: int = 1 << 20) -> Path:
    """Write the log to `path` (Parquet); with `side_tables`, `<stem>_users.parquet` and `<stem>_items.parquet`
    beside it. Returns `path`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if events < 1 or users < 1 or items < NUM_GENRES or days < 1:
        raise ValueError(f"expected events >= 1, users >= 1, items >= {NUM_GENRES}, days >= 1; got {events}, {users}, "
                         f"{items}, {days}")
    rng = np.random.default_rng(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # every user rates at least `floor` items (MovieLens keeps users with 20 or more), a few rate hundreds
    floor = min(20.0, events / (2 * users))
    activity = rng.lognormal(0.0, 0.8, users)
    activity = (floor + activity / activity.sum() * (events - floor * users)) / events
    favourites = np.stack([rng.choice(NUM_GENRES, 2, replace=False) for _ in range(users)])
    generosity = rng.normal(0.0, GENEROSITY_SD, users)
    genre = rng.integers(0, NUM_GENRES, items)
    popularity = 1.0 / np.arange(1, items + 1) ** 0.9
    rng.shuffle(popularity)
    by_genre = [np.flatnonzero(genre == g) for g in range(NUM_GENRES)]
    genre_popularity = [popularity[ids] / popularity[ids].sum() for ids in by_genre]
    start, period = 1_700_000_000, days * 86400
    schema = pa.schema([("user_id", pa.int64()), ("item_id", pa.int64()), ("timestamp", pa.int64()),
                        ("rating", pa.int8()), ("teacher_score", pa.float64())])
    chunks = -(-events // chunk)
    with pq.ParquetWriter(path, schema) as writer:
        for k in range(chunks):  # chunk k: its share of the events, in its share of the period, in time order
            n = min(chunk, events - k * chunk)
            user = rng.choice(users, n, p=activity)
            liked = rng.random(n) < 0.6
            fav = favourites[user, rng.integers(0, 2, n)]
            item = rng.choice(items, n, p=popularity / popularity.sum())
            for g in np.unique(fav[liked]):
                picks = liked & (fav == g)
                item[picks] = rng.choice(by_genre[g], int(picks.sum()), p=genre_popularity[g])
            likes = (favourites[user] == genre[item][:, None]).any(axis=1)
            teacher = BASE + np.where(likes, LIKED, DISLIKED) + generosity[user]  # the noise-free expected score
            rating = np.clip(np.rint(teacher + rng.normal(0.0, NOISE_SD, n)), 1, 5).astype(np.int8)
            times = start + np.sort(rng.uniform(k * period / chunks, (k + 1) * period / chunks, n)).astype(np.int64)
            writer.write_table(pa.table({"user_id": user + 1, "item_id": item + 1, "timestamp": times,
                                         "rating": rating, "teacher_score": teacher}, schema=schema))
    if side_tables:
        stem = path.with_suffix("")
        pq.write_table(pa.table({"user_id": np.arange(1, users + 1), "age": rng.integers(16, 75, users),
                                 "occupation": rng.choice(OCCUPATIONS, users)}), f"{stem}_users.parquet")
        pq.write_table(pa.table({"item_id": np.arange(1, items + 1),
                                 "genre": [f"genre{g:02d}" for g in genre]}), f"{stem}_items.parquet")
    return path


def teacher_eval(log_path: str | Path, built_dir: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """(teacher scores, 0/1 labels) of the log's events that `build_sequences` made eval samples in `built_dir`: the
    events at or after the global cut its `dataset.json` records, labelled rating >= its threshold."""
    import pyarrow.parquet as pq

    summary = json.loads((Path(built_dir) / "dataset.json").read_text())
    split = summary["split"]
    if "threshold" not in summary:
        raise ValueError(f"{built_dir}: its dataset.json records no threshold (an older build_sequences): build again")
    if split["mode"] != "global" or summary.get("rating") != "rating" or summary.get("threshold") is None:
        raise ValueError(f"{built_dir}: expected a build with --rating rating --threshold X and a global split, got "
                         f"label {summary['label']!r}, split {split['mode']!r}")
    log = pq.read_table(log_path, columns=["timestamp", "rating", "teacher_score"])
    is_eval = log.column("timestamp").to_numpy() >= split["cut"]
    # the same log as the build's: the same events, the same eval count
    if (log.num_rows, int(is_eval.sum())) != (summary["rows"]["events"], summary["rows"]["eval"]):
        raise ValueError(f"{log_path} has {log.num_rows:,} events, {int(is_eval.sum()):,} of them at or after the cut; "
                         f"{built_dir} was built from {summary['rows']['events']:,} with {summary['rows']['eval']:,} "
                         f"eval samples: not the log it was built from")
    labels = (log.column("rating").to_numpy()[is_eval] >= summary["threshold"]).astype(np.int8)
    return log.column("teacher_score").to_numpy()[is_eval], labels


def teacher_auc(log_path: str | Path, built_dir: str | Path) -> float:
    """The planted teacher's AUC on the eval split of `built_dir` (the best AUC any model can reach there)."""
    return _auc(*teacher_eval(log_path, built_dir))


def history_estimate_eval(log_path: str | Path, built_dir: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """(scores, 0/1 labels) on the eval events of `teacher_eval` of the teacher's form estimated from each event's
    history alone, as `build_sequences` cut it (the user's strictly earlier events, the most recent max_history):
    the favourites are the two genres most frequent there (ties: the lower genre), the generosity is the mean of the
    ratings' residuals there shrunk to its prior, N(0, GENEROSITY_SD). What a model that knows the generator can
    reach from the samples (rounding and clipping aside); the genres come from the item table beside the log
    (`--side-tables`)."""
    import pyarrow.parquet as pq

    from .build_sequences import history_bounds

    summary = json.loads((Path(built_dir) / "dataset.json").read_text())
    teacher_eval(log_path, built_dir)  # the same checks: the log the build was made from
    items_path = Path(log_path).with_suffix("").as_posix() + "_items.parquet"
    if not Path(items_path).exists():
        raise FileNotFoundError(f"{items_path}: the item table example_log --side-tables writes beside the log (the "
                                f"items' genres)")
    items = pq.read_table(items_path).to_pydict()
    genre_of = dict(zip(items["item_id"], (int(g[len("genre"):]) for g in items["genre"])))
    log = pq.read_table(log_path, columns=["user_id", "item_id", "timestamp", "rating"]).to_pydict()
    user, time, rating = (np.asarray(log[c]) for c in ("user_id", "timestamp", "rating"))
    genre = np.array([genre_of[i] for i in log["item_id"]], dtype=np.int64)
    order = np.lexsort((np.arange(user.shape[0]), time, user))  # build_sequences' order: user, time, log position
    user, time, rating, genre = user[order], time[order], rating[order].astype(np.float64), genre[order]
    n = user.shape[0]
    _, hist_start, hist_stop = history_bounds(user, time, summary["max_history"])
    is_eval = np.flatnonzero(time >= summary["split"]["cut"])
    start, stop = hist_start[is_eval], hist_stop[is_eval]
    counts = np.zeros((n + 1, NUM_GENRES), dtype=np.int32)  # prefix counts of each genre
    np.add.at(counts, (np.arange(1, n + 1), genre), 1)
    counts = np.cumsum(counts, axis=0)
    window = counts[stop] - counts[start]
    favourites = np.argsort(-window, axis=1, kind="stable")[:, :2]
    seen = stop - start
    liked_seen = np.take_along_axis(window, favourites, axis=1).sum(axis=1)
    rating_sums = np.r_[0.0, np.cumsum(rating)]
    residual = (rating_sums[stop] - rating_sums[start] - seen * BASE - liked_seen * LIKED
                - (seen - liked_seen) * DISLIKED)
    generosity = residual / (seen + (NOISE_SD / GENEROSITY_SD) ** 2)
    liked = (favourites == genre[is_eval][:, None]).any(axis=1)
    scores = BASE + np.where(liked, LIKED, DISLIKED) + generosity
    scores[seen == 0] = BASE  # no history: nothing known of the user
    labels = (rating[is_eval] >= summary["threshold"]).astype(np.int8)
    return scores, labels


def _auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """The trainer's `roc_auc` (ties count one half) of numpy scores and 0/1 labels."""
    from gem_lp.train.metrics import roc_auc

    return roc_auc(torch.from_numpy(scores), torch.from_numpy(labels))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gem_lp.data.example_log", description=__doc__.splitlines()[0])
    p.add_argument("out", nargs="?", help="the log's path (.parquet)")
    p.add_argument("--events", type=int, default=100_000)
    p.add_argument("--users", type=int, default=943)
    p.add_argument("--items", type=int, default=1682)
    p.add_argument("--days", type=int, default=215)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--side-tables", action="store_true", help="also write <stem>_users.parquet and _items.parquet")
    p.add_argument("--teacher-auc", nargs=2, metavar=("LOG", "BUILT_DIR"),
                   help="instead: print the planted teacher's AUC on the eval split build_sequences wrote to "
                        "BUILT_DIR, and its form's estimated from the samples' histories")
    a = p.parse_args(argv)
    if a.teacher_auc:
        if a.out is not None:
            p.error("--teacher-auc LOG BUILT_DIR writes nothing: give no OUT with it")
        try:
            scores, labels = teacher_eval(*a.teacher_auc)
        except (ValueError, KeyError, FileNotFoundError) as err:
            p.error(str(err))
        print(f"teacher AUC {_auc(scores, labels):.4f} on {labels.shape[0]:,} eval events "
              f"({int(labels.sum()):,} positive)")
        try:
            estimate = _auc(*history_estimate_eval(*a.teacher_auc))
        except FileNotFoundError as err:
            print(f"(no estimate from the histories alone: {err})")
        else:
            print(f"the teacher's form estimated from each event's history alone: AUC {estimate:.4f}")
        return 0
    if a.out is None:
        p.error("give the log's path OUT (or --teacher-auc LOG BUILT_DIR)")
    try:
        path = generate_log(a.out, a.events, a.users, a.items, a.days, a.seed, a.side_tables)
    except ValueError as err:
        p.error(str(err))
    print(f"wrote {a.events:,} ratings of {a.users:,} users on {a.items:,} items to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
