"""Bridges to other libraries' models and conventions, each in its own module, each an optional extra.

- :mod:`gradcache_sparton.integrations.sentence_transformers`: train a sentence-transformers
  ``SparseEncoder`` with the fused head and the GradCache engine, keeping its type and save format
  (extra ``sentence-transformers``); a package, one job per module (conversion, loss mapping, data
  columns, export, model cards). :mod:`gradcache_sparton.integrations.sentence_transformers_modules`
  holds the modules its saved checkpoints name.

Nothing here is imported by ``import gradcache_sparton``; each module imports its library only when a
function that needs it is called.
"""

__all__: list[str] = []
