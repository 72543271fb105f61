"""Console entry point ``gradcache-sparton``: ``train``, ``evaluate``, ``mine``, ``teacher``, ``export``
(index files or an ONNX model), ``idf`` and ``crossval``.

``train`` parses :class:`~gradcache_sparton.arguments.ModelArguments`,
:class:`~gradcache_sparton.arguments.DataArguments` and
:class:`~gradcache_sparton.arguments.CachedSpladeTrainingArguments` with ``HfArgumentParser``. Values
come from, in increasing priority: the dataclass defaults, a config file, then the flags. The config
file is ``--config FILE.yaml|json``; ``--config default``, or no ``--config`` and no flag naming a model
or training data, is the shipped ``resources/default_train.yaml`` (the embedded default run). A run that
names its own model or data therefore never inherits the demo's steps, learning rate or lengths; every
value a config file sets and no flag overrides is logged at the start.

``evaluate``, ``mine``, ``teacher``, ``export`` and ``crossval`` parse dataclasses the same way
(:func:`.options.parse_command`; ``idf``'s few flags are plain argparse);
the checkpoint options they share (``--model_name_or_path``, ``--query_max_length``,
``--document_max_length``, ``--batch_size``, ``--device``) are declared once, in :mod:`.options`.

One command a module (:mod:`.train`, :mod:`.evaluate`, :mod:`.mine`, :mod:`.teacher`, :mod:`.export`, :mod:`.idf`,
:mod:`.crossval`, the last reading :mod:`gradcache_sparton.crossval`'s settings); ``train``'s help by theme in
:mod:`.train_help`; the commands' one-line help in :mod:`.commands`; the top-level parser and dispatch in
:mod:`.app`, which fits torch's threads to the free cores first (:mod:`.threads`); ``python -m
gradcache_sparton.cli`` runs it (:mod:`.__main__`).
"""

from gradcache_sparton.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
