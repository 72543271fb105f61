"""The commands of ``gradcache-sparton`` and their one-line help (the top-level help and each command's)."""

__all__ = ["COMMANDS"]

COMMANDS = {
    "train": "train a SPLADE model with GradCache (default: the embedded SciFact run)",
    "evaluate": "retrieval metrics (nDCG@10, MRR@10, Recall@100) of a checkpoint on a BEIR folder",
    "mine": "hard negatives (BM25 or a checkpoint's own ranking) written as a training file",
    "teacher": "teacher scores (a checkpoint, a sentence-transformers model, BM25 or an ensemble) added to a training file",
    "export": "a BEIR corpus encoded into a seismic or Anserini index file, or the document encoder as an ONNX model",
    "idf": "an inference-free model: a checkpoint's document encoder and the IDF query table of a corpus",
    "crossval": "k-fold cross-validation of a training recipe against zero-shot and BM25 (docs/experiments.md)",
}
