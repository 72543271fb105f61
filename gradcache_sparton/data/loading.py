"""Loading training rows from files (jsonl/json/csv/parquet, optionally compressed) or a Dataset."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from gradcache_sparton.data.validation import validate_training_dataset

if TYPE_CHECKING:
    import datasets

__all__ = ["load_training_data"]

_LOAD_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
_COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")


def _builder_for(path: Path) -> str:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in _COMPRESSIONS:
        suffixes = suffixes[:-1]
    if not suffixes or suffixes[-1] not in _LOAD_BUILDERS:
        raise ValueError(
            f"cannot tell the format of {str(path)!r}: expected one of {sorted(_LOAD_BUILDERS)} "
            f"(optionally compressed: {list(_COMPRESSIONS)})"
        )
    return _LOAD_BUILDERS[suffixes[-1]]


def load_training_data(
    source: str | Path | Sequence[str | Path] | datasets.Dataset,
    *,
    cache_dir: str | Path | None = None,
) -> datasets.Dataset:
    """Load training rows from files (jsonl/json/csv/parquet, optionally .gz/.bz2/.xz/.zst) or take a
    ``datasets.Dataset`` as it is, and validate it with :func:`validate_training_dataset`.

    Several files must share one format. ``cache_dir`` is passed to ``datasets.load_dataset``. Returns
    the dataset unchanged (validation never rewrites rows).
    """
    import datasets

    if isinstance(source, datasets.Dataset):
        dataset = source
    else:
        paths = [Path(source)] if isinstance(source, (str, Path)) else [Path(p) for p in source]
        if not paths:
            raise ValueError("source is an empty list of files")
        for path in paths:
            if not path.is_file():
                raise ValueError(f"training data file {str(path)!r} does not exist")
        builders = {_builder_for(path) for path in paths}
        if len(builders) != 1:
            raise ValueError(f"all training files must have one format, got {sorted(builders)}")
        dataset = datasets.load_dataset(
            builders.pop(),
            data_files=[str(path) for path in paths],
            split="train",
            cache_dir=None if cache_dir is None else str(cache_dir),
        )
    validate_training_dataset(dataset)
    return dataset
