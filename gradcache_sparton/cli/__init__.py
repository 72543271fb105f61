"""Console entry point ``gradcache-sparton``: ``train``, ``evaluate``, ``mine`` and ``export``.

``train`` parses :class:`~gradcache_sparton.arguments.ModelArguments`,
:class:`~gradcache_sparton.arguments.DataArguments` and
:class:`~gradcache_sparton.arguments.CachedSpladeTrainingArguments` with ``HfArgumentParser``. Values
come from, in increasing priority: the dataclass defaults, a config file, then the flags. The config
file is ``--config FILE.yaml|json``; ``--config default``, or no ``--config`` and no flag naming a model
or training data, is the shipped ``resources/default_train.yaml`` (the embedded default run). A run that
names its own model or data therefore never inherits the demo's steps, learning rate or lengths; every
value a config file sets and no flag overrides is logged at the start.

``evaluate``, ``mine`` and ``export`` parse dataclasses the same way (:func:`.options.parse_command`);
the checkpoint options they share (``--model_name_or_path``, ``--query_max_length``,
``--document_max_length``, ``--batch_size``, ``--device``) are declared once, in :mod:`.options`.

One command a module (:mod:`.train`, :mod:`.evaluate`, :mod:`.mine`, :mod:`.export`; ``crossval`` is
:mod:`gradcache_sparton.crossval`'s); ``train``'s help by theme in :mod:`.train_help`; the top-level
parser and dispatch in :mod:`.app`.
"""

from gradcache_sparton.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
