"""The ground floor: small types and device helpers shared by the engine, the kernels, the losses and
evaluation. They import nothing else from the package.

- :mod:`~gradcache_sparton.primitives.sparse_reps`: :class:`SparseReps`, N sparse reps in compressed-row
  layout (offsets, vocabulary ids, weights);
- :mod:`~gradcache_sparton.primitives.host_count`: :class:`HostCount`, a count read on the host without
  stalling the host's queue of work;
- :mod:`~gradcache_sparton.primitives.forward_memo`: :class:`ForwardMemo`, the contract by which a module
  hands GradCache Step (1)'s memo what Step (3) needs to skip its forward (the engine owns the memo);
- :mod:`~gradcache_sparton.primitives.column_routing`: :func:`call_encoder`, how an encoder that encodes
  each column its own way (``routes_by_column``) is called with the column's name;
- :mod:`~gradcache_sparton.primitives.option_field`: :func:`option`, how every configuration dataclass declares
  a field (its default and its help text);
- :mod:`~gradcache_sparton.primitives.option_types`: :func:`check_value_types`, a configuration file's values
  checked against the types of the fields they set.
- :mod:`~gradcache_sparton.primitives.query_encoders`: the names of a model's query encoder (``"splade"``, or an
  inference-free query table: ``"idf"``, ``"learned_idf"``, ``"li_lsr"``), from the flag to the model folder.
"""

from gradcache_sparton.primitives.forward_memo import (
    ForwardMemo,
    recording,
    recording_memo,
    replaying,
    replaying_memo,
)
from gradcache_sparton.primitives.host_count import HostCount
from gradcache_sparton.primitives.option_field import option
from gradcache_sparton.primitives.sparse_reps import SparseReps

__all__ = [
    "ForwardMemo",
    "HostCount",
    "SparseReps",
    "option",
    "recording",
    "recording_memo",
    "replaying",
    "replaying_memo",
]
