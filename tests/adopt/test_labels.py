"""Precision and recall of the built-in rules on the labelled development set (tests/data/adopt-labels,
labelled by reading the code; conventions in docs/adopt-labels.md): 46 files of transformers
4.35.2 (fetched once with pip, read as data) and of the installed 5.24.0."""
from pathlib import Path

import pytest

from kiln.adopt import corpus

LABELS = Path(__file__).resolve().parent.parent / "data" / "adopt-labels"


@pytest.fixture(scope="module")
def scores():
    labelled = corpus.load_labels(LABELS)
    found = {}
    for entry in labelled:
        try:
            root = corpus.corpus_root(entry["corpus"])
        except corpus.CorpusError as exc:        # no network and no cached copy: nothing to score
            pytest.skip(str(exc))
        res = corpus.evaluate(root, [root / entry["path"]])[0]
        assert res.error is None, f"{entry['path']}: {res.error}"
        found[(entry["corpus"], entry["path"])] = corpus.location_set(res.matches)
    return corpus.score(labelled, found)


def test_the_set_is_big_enough():
    labelled = corpus.load_labels(LABELS)
    assert len(labelled) >= 30 and {e["corpus"] for e in labelled} == {"4.35.2", "5.24.0"}
    assert len({(e["corpus"], e["path"]) for e in labelled}) == len(labelled), "a file is labelled twice"
    rules = {loc["rule"] for e in labelled for loc in e["locations"]}
    assert rules <= set(corpus.RULE_ORDER)


def test_precision_is_one(scores):
    extras = {r: row["false_positives"] for r, row in scores["rules"].items() if row["false_positives"]}
    assert scores["precision"] == 1.0, f"locations found that are not labelled: {extras}"


def test_recall_overall_and_per_rule(scores):
    misses = {r: row["missed"] for r, row in scores["rules"].items() if row["missed"]}
    assert scores["recall"] >= 0.95, f"missed: {misses}"
    for rule, row in scores["rules"].items():
        if row["labelled"]:
            assert row["recall"] >= 0.85, f"{rule}: recall {row['recall']:.2f}, missed {row['missed']}"
