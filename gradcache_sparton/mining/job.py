"""The ``gradcache-sparton mine`` job, usable from Python too: read pairs, mine, write a training file."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Literal

import torch

from gradcache_sparton.data import beir_folder, default_dev_beir_path, default_train_data_path, load_beir
from gradcache_sparton.data.output import check_output_path, write_training_file
from gradcache_sparton.evaluation import EncodingSettings
from gradcache_sparton.mining.negatives import check_mining_settings, mine_hard_negatives
from gradcache_sparton.mining.pairs import beir_mining_pairs, load_mining_pairs
from gradcache_sparton.mining.rankings import BM25_STEMMER, check_bm25_installed

__all__ = ["CORPORA", "run_mining"]

logger = logging.getLogger(__name__)

CORPORA = ("beir", "positives")


def run_mining(
    *,
    output_file: str | Path,
    train_data: str | Path | None = None,
    beir_path: str | Path | None = None,
    split: str | None = None,
    corpus: Literal["beir", "positives"] | None = None,
    method: Literal["bm25", "splade"] = "bm25",
    model_name_or_path: str | None = None,
    num_negatives: int = 2,
    rank_start: int = 10,
    rank_end: int = 100,
    sampling: Literal["random", "top"] = "random",
    seed: int = 0,
    query_max_length: int | None = None,
    document_max_length: int | None = None,
    batch_size: int = 64,
    device: str | None = None,
    bm25_stemmer: str | None = BM25_STEMMER,
    overwrite: bool = False,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Mine hard negatives and write them as a training file; returns a summary (rows, seconds, ...).

    Pairs come from ``train_data`` (jsonl: ``query``, ``positive`` [, ``query_id``, ``positive_id``])
    or, without it, from the judgements with relevance > 0 of the BEIR folder ``beir_path`` (qrels
    ``split``, default ``train``; ``beir_path="default"`` is the shipped SciFact dev sample, split ``dev``).
    With neither, the shipped SciFact training pairs (``default_train_data_path()``) are mined among their
    own positives: a training file for the shipped data, never from the dev sample it is evaluated on. The corpus mined from is ``corpus="beir"`` (the BEIR folder's corpus; the default when
    ``beir_path`` is given) or ``"positives"`` (the distinct positives of the pairs). ``method="splade"``
    ranks with the checkpoint ``model_name_or_path`` (a folder, a shipped model's name or a hub id),
    loaded as ``evaluate`` loads it (its own tokenizer), on ``device`` (default: cuda when available),
    at the max lengths given, else those it was trained with, else 32 / 256 tokens. The other settings are :func:`~gradcache_sparton.mining.mine_hard_negatives`'s.

    Every setting, the output path (``.jsonl`` / ``.jsonl.gz``; an existing file needs ``overwrite``)
    and the input paths are checked before anything is loaded; a checkpoint that does not load fails
    before the data is read.
    """
    # checked here, before anything is loaded, and again by mine_hard_negatives, which takes them as they are
    settings: dict[str, Any] = {
        "num_negatives": num_negatives,
        "rank_start": rank_start,
        "rank_end": rank_end,
        "sampling": sampling,
        "method": method,
    }
    check_mining_settings(**settings)
    output = check_output_path(output_file, overwrite=overwrite)
    if train_data is None and beir_path is None:
        train_data = default_train_data_path()
        logger.info(
            "No train_data or beir_path: mining the shipped SciFact training pairs among their positives."
        )
    if beir_path is not None:
        beir_path = beir_folder(beir_path, split=split)
        split = split or ("dev" if Path(beir_path) == default_dev_beir_path() else "train")
    elif split is not None:
        raise ValueError(f"split {split!r} is a qrels split of beir_path, which is not given")
    if train_data is not None and not Path(train_data).is_file():
        raise ValueError(f"train_data {str(train_data)!r} does not exist")
    if beir_path is not None and not Path(beir_path).is_dir():
        raise ValueError(f"beir_path {str(beir_path)!r} is not a directory")
    corpus = corpus if corpus is not None else ("beir" if beir_path is not None else "positives")
    if corpus not in CORPORA:
        raise ValueError(f"corpus must be one of {CORPORA}, got {corpus!r}")
    if corpus == "beir" and beir_path is None:
        raise ValueError(
            "corpus='beir' needs beir_path (or mine among the pairs' positives: corpus='positives')"
        )
    if method == "splade":
        if model_name_or_path is None:
            raise ValueError("method='splade' needs model_name_or_path (a checkpoint)")
    elif model_name_or_path is not None:
        raise ValueError("model_name_or_path is only used by method='splade' (method is 'bm25')")
    else:
        check_bm25_installed(bm25_stemmer)

    start = time.perf_counter()
    encoder_settings: dict[str, Any] = {}
    if method == "splade":  # first: a checkpoint that does not load fails before the data is read
        from gradcache_sparton.arguments import ModelArguments
        from gradcache_sparton.model_loading import build_encoder, build_tokenizer, checkpoint_max_lengths

        query_max_length, document_max_length = checkpoint_max_lengths(
            model_name_or_path, query_max_length=query_max_length, document_max_length=document_max_length
        )
        model_args = ModelArguments(model_name_or_path=model_name_or_path)
        tokenizer = build_tokenizer(model_args)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        encoding = EncodingSettings(
            tokenizer,
            query_max_length=query_max_length,
            document_max_length=document_max_length,
            batch_size=batch_size,
            device=device,
            show_progress=show_progress,
        )
        encoder_settings = {
            "encoder": build_encoder(model_args, tokenizer).to(device).eval(),
            "encoding": encoding,
        }
    needs_beir = beir_path is not None and (train_data is None or corpus == "beir")
    beir = load_beir(beir_path, split=split) if needs_beir else None
    pairs = load_mining_pairs(train_data) if train_data is not None else beir_mining_pairs(beir)
    mined = mine_hard_negatives(
        pairs,
        corpus=beir.corpus if corpus == "beir" else None,
        seed=seed,
        bm25_stemmer=bm25_stemmer,
        show_progress=show_progress,
        **settings,
        **encoder_settings,
    )
    write_training_file(mined, output, overwrite=overwrite)
    seconds = time.perf_counter() - start
    logger.info("wrote %d rows to %s in %.1f s", len(mined), output, seconds)
    return {
        "output_file": str(output),
        "rows": len(mined),
        "num_negatives": num_negatives,
        "method": method,
        "corpus": corpus,
        "seconds": round(seconds, 2),
    }
