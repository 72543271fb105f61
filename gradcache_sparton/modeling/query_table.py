"""The query encoder of an inference-free model: one weight per vocabulary token, no transformer.

Legend: B batch, S sequence, V vocabulary.

A query's rep is the weight of each distinct token it contains:

    q[b, v] = w[v] · 1[v occurs at an attended position of row b, v not a special token]

so a token repeated in a query counts once, padding and special tokens ([CLS], [SEP], [PAD], ...) never
count, and the rep has at most S non-zeros. This is sentence-transformers' ``SparseStaticEmbedding``
(which tokenizes queries without special tokens; masking them here gives the same reps from the
collator's usual tokenization, except for a query whose text spells a special token literally). The
weights are free parameters: they may be learned (:attr:`QueryTable.frozen` False), and a learned weight
may become negative, as in sentence-transformers.

The weights usually start as the IDF of the training corpus, :func:`idf_weights`:

    idf[v] = log(1 + (N - df[v] + 0.5) / (df[v] + 0.5))

with N the documents that have a non-special token and df[v] how many of them contain token v (BM25's
IDF, always > 0, as the OpenSearch neural-sparse sample computes it; a token no document contains gets
the largest value, df = 0), special tokens 0. Texts are tokenized without special tokens and without
truncation.

On disk (:func:`save_query_table`, :func:`load_query_table`): ``query_table.safetensors`` beside a
model's weights, one fp32 tensor ``weight`` [V] and the metadata ``special_token_ids`` (a JSON list,
required: a table without it is refused, since which ids never count cannot be known from the weights)
and ``frozen`` (``"true"``/``"false"``, default true). For a search engine or sentence-transformers,
:func:`write_token_weights` writes the same weights as ``idf.json``: a JSON object token -> weight over
every token id in id order, the format of sentence-transformers' ``SparseStaticEmbedding.from_json`` and
of OpenSearch's inference-free tokenizers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from gradcache_sparton.modeling.checkpoint import record_query_encoder

__all__ = [
    "QUERY_TABLE_NAME",
    "TOKEN_WEIGHTS_NAME",
    "QueryTable",
    "has_query_table",
    "idf_weights",
    "load_query_table",
    "query_table_parameters",
    "save_query_table",
    "write_token_weights",
]

#: The query table's file in a model folder.
QUERY_TABLE_NAME = "query_table.safetensors"
#: The token -> weight JSON written for search engines and sentence-transformers.
TOKEN_WEIGHTS_NAME = "idf.json"
# Texts tokenized at once when counting document frequencies.
_IDF_BATCH = 1024


class QueryTable(nn.Module):
    """``table(input_ids, attention_mask) -> [B, V]``: each distinct non-special token's weight (module doc).

    Args:
        weight: [V] the weight of each token id (copied to an fp32 parameter).
        special_token_ids: ids that never count (e.g. ``tokenizer.all_special_ids``).
        frozen: True: the weights are not trained (``requires_grad=False``).
    """

    #: The ``kind`` metadata of its file: absent or ``"static"`` for this class; each subclass names its own
    #: (:mod:`.li_lsr`'s ``"li_lsr"``), and :func:`load_query_table` builds the class its file names.
    kind: ClassVar[str] = "static"
    _kinds: ClassVar[dict[str, type[QueryTable]]] = {}

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        QueryTable._kinds[cls.kind] = cls

    def __init__(self, weight: Tensor, *, special_token_ids: Sequence[int] = (), frozen: bool = True) -> None:
        super().__init__()
        if not isinstance(weight, Tensor) or weight.dim() != 1 or weight.numel() == 0:
            raise ValueError(f"weight must be a non-empty 1-D tensor [V], got {_describe(weight)}")
        if not weight.is_floating_point() or not bool(torch.isfinite(weight).all()):
            raise ValueError("weight must hold finite floating-point values")
        if not isinstance(frozen, bool):
            raise TypeError(f"frozen must be a bool, got {type(frozen).__name__}")
        vocab_size = weight.numel()
        ids = sorted(set(special_token_ids))
        bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size]
        if bad:
            raise ValueError(f"special_token_ids must be ints in [0, {vocab_size}), got {bad}")
        self.weight = nn.Parameter(weight.detach().to(torch.float32).clone(), requires_grad=not frozen)
        self.register_buffer("_special_token_ids", torch.tensor(ids, dtype=torch.long), persistent=False)

    @property
    def vocab_size(self) -> int:
        """V, the width of the reps."""
        return self.weight.numel()

    @property
    def frozen(self) -> bool:
        """Whether the weights are left out of training."""
        return not self.weight.requires_grad

    @property
    def special_token_ids(self) -> tuple[int, ...]:
        """Token ids that never count."""
        return tuple(self._special_token_ids.tolist())

    @property
    def query_encoder(self) -> str:
        """The model's query encoder this table is (``splade_config.json``'s ``query_encoder``): ``"idf"``
        frozen, ``"learned_idf"`` trained."""
        return "idf" if self.frozen else "learned_idf"

    def forward(self, input_ids: Tensor, attention_mask: Tensor, **unused: Tensor) -> Tensor:
        """[B, S] ``input_ids``/``attention_mask`` -> [B, V] reps (fp32); other features (token_type_ids) unused."""
        present = torch.zeros(input_ids.shape[0], self.vocab_size, device=input_ids.device)  # [B, V]
        # amax: a token counts if any of its positions is attended (scatter_ would pick one of them at random).
        present.scatter_reduce_(
            1, input_ids, attention_mask.to(present.dtype), reduce="amax"
        )  # [B, S] -> [B, V]
        if self._special_token_ids.numel():
            present[:, self._special_token_ids] = 0
        return present * self.weight  # [B, V] · [V] -> [B, V]

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, frozen={self.frozen}, special_token_ids={list(self.special_token_ids)}"

    def file_contents(self) -> tuple[dict[str, Tensor], dict[str, str]]:
        """The tensors (fp32, on the CPU) and metadata of its ``query_table.safetensors`` (module doc)."""
        metadata = {
            "special_token_ids": json.dumps(list(self.special_token_ids)),
            "frozen": "true" if self.frozen else "false",
        }
        if self.kind != QueryTable.kind:
            metadata["kind"] = self.kind
        return {
            name: t.detach().to("cpu", torch.float32).contiguous() for name, t in self.state_dict().items()
        }, metadata

    @classmethod
    def from_tensors(
        cls, tensors: Mapping[str, Tensor], *, special_token_ids: Sequence[int], frozen: bool
    ) -> QueryTable:
        """The table holding ``tensors`` (its state dict, as :meth:`file_contents` writes them)."""
        if set(tensors) != {"weight"}:
            raise ValueError(f"a query table holds one tensor 'weight' [V], got {sorted(tensors)}")
        return cls(tensors["weight"], special_token_ids=special_token_ids, frozen=frozen)

    def with_tensors(self, tensors: Mapping[str, Tensor]) -> QueryTable:
        """A table of this kind, special tokens and ``frozen`` holding ``tensors`` (e.g. a gathered state dict)."""
        return type(self).from_tensors(tensors, special_token_ids=self.special_token_ids, frozen=self.frozen)


def idf_weights(texts: Iterable[str], tokenizer: PreTrainedTokenizerBase) -> Tensor:
    """[V] fp32 IDF of every token of ``tokenizer`` over the documents ``texts`` (module doc: formula).

    ``ValueError`` if no text has a non-special token (no document to count).
    """
    vocab_size = len(tokenizer)
    special = torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=torch.long)
    df = torch.zeros(vocab_size, dtype=torch.long)
    documents = 0
    batch: list[str] = []

    def count(batch: list[str]) -> int:
        ids = tokenizer(batch, add_special_tokens=False, truncation=False, verbose=False)["input_ids"]
        counted = 0
        for row in ids:
            distinct = torch.unique(torch.tensor(row, dtype=torch.long))
            distinct = distinct[~torch.isin(distinct, special)]
            if distinct.numel():
                df[distinct] += 1
                counted += 1
        return counted

    for text in texts:
        if not isinstance(text, str):
            raise TypeError(f"texts must be strings, got {type(text).__name__}")
        batch.append(text)
        if len(batch) == _IDF_BATCH:
            documents += count(batch)
            batch = []
    if batch:
        documents += count(batch)
    if documents == 0:
        raise ValueError("no document has a token to count (every text is empty or special tokens only)")
    idf = torch.log1p((documents - df.double() + 0.5) / (df.double() + 0.5)).to(torch.float32)  # [V]
    idf[special] = 0.0
    return idf


def query_table_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters of every query table in ``model``, once each: ours (:class:`QueryTable` and its
    subclasses) and sentence-transformers' ``SparseStaticEmbedding`` (known by its class name, so the library
    is not imported)."""
    found: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if isinstance(module, QueryTable) or type(module).__name__ == "SparseStaticEmbedding":
            found.update({id(p): p for p in module.parameters() if p.requires_grad})
    return list(found.values())


def has_query_table(folder: str | os.PathLike) -> bool:
    """Whether the local model folder holds a query table (it is an inference-free model)."""
    return (Path(folder) / QUERY_TABLE_NAME).is_file()


def save_query_table(table: QueryTable, folder: str | os.PathLike) -> Path:
    """Write ``table`` as ``folder/query_table.safetensors`` (module doc) and record its
    :attr:`~QueryTable.query_encoder` in the folder's ``splade_config.json`` where it has one (the folder is
    then this table's inference-free model); returns the file."""
    from safetensors.torch import save_file

    path = Path(folder) / QUERY_TABLE_NAME
    tensors, metadata = table.file_contents()
    _replace(path, lambda partial: save_file(tensors, str(partial), metadata))
    record_query_encoder(folder, table.query_encoder)
    return path


def load_query_table(folder: str | os.PathLike, *, frozen: bool | None = None) -> QueryTable:
    """The table of ``folder/query_table.safetensors``; ``frozen`` None: as saved.

    ``ValueError`` naming the file when it is unreadable, has no [V] fp32 ``weight``, no ``special_token_ids``
    metadata (module doc) or bad metadata.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(folder) / QUERY_TABLE_NAME
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            kind = metadata.get("kind", QueryTable.kind)
            if kind != QueryTable.kind:  # another kind of table: its class reads its tensors
                names = f.keys()  # safe_open is not iterable
                tensors = {name: f.get_tensor(name) for name in names}
                return _load_kind(path, kind, tensors, metadata, frozen=frozen)
            if set(f.keys()) != {"weight"}:
                raise ValueError(f"{path} must hold one tensor 'weight' [V], got {sorted(f.keys())}")
            weight = f.get_tensor("weight")
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{path} is not a readable safetensors file ({exc})") from None
    special, saved_frozen = _read_metadata(path, metadata)
    if weight.dim() != 1 or weight.dtype != torch.float32:
        raise ValueError(
            f"{path}: weight must be a 1-D fp32 tensor [V], got {tuple(weight.shape)} {weight.dtype}"
        )
    try:
        return QueryTable(
            weight, special_token_ids=special, frozen=saved_frozen if frozen is None else frozen
        )
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


def _read_metadata(path: Path, metadata: dict[str, str]) -> tuple[list[int], bool]:
    """The special token ids and ``frozen`` of the table file ``path`` (module doc); ``ValueError`` naming
    the file when ``special_token_ids`` is missing (a table made elsewhere: which ids never count cannot be
    known, and [CLS] and [SEP] would count in every query) or either is malformed."""
    if "special_token_ids" not in metadata:
        raise ValueError(
            f"{path} has no special_token_ids in its metadata: which ids never count cannot be known (a table "
            "from elsewhere); write it with save_query_table, or with safetensors' metadata "
            '{"special_token_ids": json.dumps(tokenizer.all_special_ids)}'
        )
    try:
        special = json.loads(metadata["special_token_ids"])
    except json.JSONDecodeError:
        special = None
    if not isinstance(special, list) or metadata.get("frozen", "true") not in ("true", "false"):
        raise ValueError(
            f"{path}: metadata must have special_token_ids (a JSON list) and frozen ('true'/'false'), got {metadata}"
        )
    return special, metadata.get("frozen", "true") == "true"


def _load_kind(
    path: Path, kind: str, tensors: dict[str, Tensor], metadata: dict[str, str], *, frozen: bool | None
) -> QueryTable:
    """The table of kind ``kind`` in the file ``path`` (its ``tensors`` and ``metadata``)."""
    if kind not in QueryTable._kinds:
        raise ValueError(
            f"{path}: metadata kind {kind!r} is not a query table kind ({sorted(QueryTable._kinds)})"
        )
    special, saved_frozen = _read_metadata(path, metadata)
    try:
        return QueryTable._kinds[kind].from_tensors(
            tensors, special_token_ids=special, frozen=saved_frozen if frozen is None else frozen
        )
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{path}: {exc}") from None


def write_token_weights(
    table: QueryTable, tokenizer: PreTrainedTokenizerBase, path: str | os.PathLike
) -> Path:
    """Write the table as a token -> weight JSON object over every token id, in id order (module doc).

    ``ValueError`` unless the tokenizer has one token per table entry.
    """
    if len(tokenizer) != table.vocab_size:
        raise ValueError(
            f"the tokenizer has {len(tokenizer)} tokens but the query table {table.vocab_size} weights"
        )
    tokens = tokenizer.convert_ids_to_tokens(list(range(table.vocab_size)))
    weights = table.weight.detach().to("cpu", torch.float64).tolist()  # each fp32 value exactly
    mapping = dict(zip(tokens, weights, strict=True))
    if len(mapping) != len(tokens):
        raise ValueError(
            "the tokenizer maps two ids to one token string: a token -> weight file cannot hold it"
        )
    text = json.dumps(mapping, ensure_ascii=False) + "\n"
    return _replace(Path(path), lambda partial: partial.write_text(text, encoding="utf-8"))


def _replace(path: Path, write: Callable[[Path], object]) -> Path:
    """``write`` a new file beside ``path``, then rename it onto ``path``: a symlink there is replaced, never
    written through (the file it points to, perhaps outside the folder, stays as it was)."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        write(partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return path


def _describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__
