"""The large-batch experiment's pairs: disjoint passages, nothing from the dev set, a multiple of the batch."""

from __future__ import annotations

from types import ModuleType

import pytest
from script_helpers import import_script

from gradcache_sparton.data import default_dev_beir_path, load_beir, split_sentences


@pytest.fixture(scope="module")
def experiment() -> ModuleType:
    """scripts/large_batch_experiment.py imported as a module."""
    return import_script("scripts", "large_batch_experiment")


def test_passages_of_merges_a_lone_last_sentence(experiment: ModuleType) -> None:
    """Passages are consecutive groups; a lone trailing sentence joins the previous group, none is lost."""
    assert experiment.passages_of(["A.", "B.", "C.", "D.", "E."], 2) == ["A. B.", "C. D. E."]
    assert experiment.passages_of(["A.", "B.", "C."], 3) == ["A. B. C."]
    assert experiment.passages_of(["A."], 2) == []


def test_pairs_share_no_sentence_and_hold_out_dev(experiment: ModuleType) -> None:
    """No sentence is in two pairs (no in-batch pair contains another's query) and none is from dev."""
    pairs, stats = experiment.build_pairs(sentences_per_passage=2, pair_multiple=4096, seed=0)
    assert len(pairs) == stats["pairs_used"] == 8192
    seen: set[str] = set()
    for row in pairs:
        sentences = [row["query"], *split_sentences(row["positive"])]
        assert not seen.intersection(sentences)
        seen.update(sentences)
    dev = load_beir(default_dev_beir_path(), split="dev")
    relevant = {doc for judged in dev.qrels.values() for doc, rel in judged.items() if rel > 0}
    dev_sentences = {s for doc in relevant for s in split_sentences(dev.corpus[doc])}
    assert not seen & (dev_sentences | set(dev.queries.values()))
