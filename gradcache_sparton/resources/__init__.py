"""Files shipped with the package (tokenizer, pretrained model, default data sample): nothing at run time needs a hub.

Licences and provenance: ``resources/NOTICE.md``.
"""

from pathlib import Path

__all__ = [
    "RESOURCES_DIR",
    "SHIPPED_MODELS",
    "default_tokenizer_path",
    "default_train_config_path",
    "shipped_model_path",
]

RESOURCES_DIR = Path(__file__).resolve().parent

#: Pretrained checkpoints shipped inside the package, by the name ``model_name_or_path`` accepts.
SHIPPED_MODELS = ("splade-tiny-msmarco",)


def default_tokenizer_path() -> Path:
    """Folder of the bundled bert-base-uncased tokenizer (Apache-2.0; see resources/NOTICE.md)."""
    return RESOURCES_DIR / "bert-base-uncased-tokenizer"


def default_train_config_path() -> Path:
    """The embedded default run of ``gradcache-sparton train`` (``--config default``)."""
    return RESOURCES_DIR / "default_train.yaml"


def shipped_model_path(name: str) -> Path | None:
    """Folder of the shipped checkpoint called ``name`` (see :data:`SHIPPED_MODELS`), else None."""
    return RESOURCES_DIR / name if name in SHIPPED_MODELS else None
