"""Files shipped with the package (tokenizer, default data sample), so nothing at run time needs a hub."""

from pathlib import Path

__all__ = ["RESOURCES_DIR", "default_tokenizer_path", "default_train_config_path"]

RESOURCES_DIR = Path(__file__).resolve().parent


def default_tokenizer_path() -> Path:
    """Folder of the bundled bert-base-uncased tokenizer (Apache-2.0; see resources/NOTICE.md)."""
    return RESOURCES_DIR / "bert-base-uncased-tokenizer"


def default_train_config_path() -> Path:
    """The embedded default run of ``gradcache-sparton train`` (``--config default``)."""
    return RESOURCES_DIR / "default_train.yaml"
