"""The GradCache engine's checks: inputs before any work, reps as they come, the replay against Step (1).

- Inputs, once per step before any encoding: :func:`check_columns` (shapes, one device, what the
  options need), :func:`check_loss_kwargs`, :func:`check_token_ids` (against the encoder's
  vocabulary), :func:`check_autograd_inputs` (nothing made under ``inference_mode``).
- Outputs: :func:`check_rep` (each Step (1) mini-batch), :func:`check_loss_output` (Step (2)),
  :func:`check_replayed_rep` (each Step (3) mini-batch), :func:`raise_if_non_finite`.
- The replay check (``check_replay``): :func:`fingerprint` each mini-batch's reps in Step (1) and
  Step (3), compared on the device and read back once by :func:`raise_if_not_reproduced`.
- The notes a failure carries: :func:`encode_failure_note`, :func:`replay_failure_note`.

Each raises one clear error naming the column, feature or option, before the work it guards.

Legend: B batch (rows of a column), S sequence, V rep width, mb rows of a mini-batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor, nn

from gradcache_sparton.engine.config import GradCacheConfig
from gradcache_sparton.engine.distributed import holds_on_every_rank
from gradcache_sparton.engine.mini_batch import Rows, describe_rows, row_count
from gradcache_sparton.engine.types import Columns, Features, LossOutput, MiniBatch

__all__ = [
    "check_autograd_inputs",
    "check_columns",
    "check_graphable",
    "check_loss_kwargs",
    "check_loss_output",
    "check_rep",
    "check_replayed_rep",
    "check_token_ids",
    "encode_failure_note",
    "fingerprint",
    "fingerprints_differ",
    "raise_if_non_finite",
    "raise_if_not_reproduced",
    "replay_failure_note",
    "rows_of",
]


def rows_of(features: Features) -> int:
    """A column's rows (its features' shared first dimension: :func:`check_columns`)."""
    return next(iter(features.values())).shape[0]


# ---------------------------------------------------------------------------------------------- inputs


def check_columns(columns: Columns, config: GradCacheConfig) -> None:
    """Raise TypeError/ValueError naming the column and feature for malformed input columns, or columns
    the configuration cannot cut (``mini_batch_tokens`` without a mask, a ``mini_batch_size`` mapping
    without one entry per column, different row counts under ``same_batch_size``)."""
    if not isinstance(columns, Mapping) or not columns:
        raise ValueError("columns must be a non-empty mapping of column name -> features")
    batch_sizes: dict[str, int] = {}
    for column, features in columns.items():
        if not isinstance(features, Mapping) or not features:
            raise TypeError(f"column {column!r} must be a non-empty mapping of feature name -> Tensor")
        for name, value in features.items():
            if not isinstance(value, Tensor):
                raise TypeError(
                    f"feature {name!r} of column {column!r} must be a torch.Tensor, got "
                    f"{type(value).__name__} (tokenize with return_tensors='pt')"
                )
            if value.ndim == 0:
                raise ValueError(f"feature {name!r} of column {column!r} must have a batch dimension")
        rows = {name: value.shape[0] for name, value in features.items()}
        if len(set(rows.values())) != 1:
            raise ValueError(f"features of column {column!r} have different batch sizes: {rows}")
        batch_sizes[column] = rows_of(features)
        if batch_sizes[column] == 0:
            raise ValueError(f"column {column!r} is an empty batch (0 rows)")
        mask = features.get("attention_mask")
        if config.mini_batch_tokens is not None and (mask is None or mask.ndim != 2):
            raise ValueError(
                f"mini_batch_tokens needs an attention_mask [B, S] in every column to measure row "
                f"lengths; column {column!r} has {'none' if mask is None else f'one of shape {list(mask.shape)}'}"
            )
    _check_one_device(columns)
    if config.same_batch_size and len(set(batch_sizes.values())) != 1:
        raise ValueError(
            f"columns have different batch sizes {batch_sizes}; the loss needs them equal "
            "(pass same_batch_size=False for a loss whose columns differ in size)"
        )
    sizes = config.mini_batch_size
    if isinstance(sizes, Mapping) and set(sizes) != set(columns):
        missing = sorted(set(columns) - set(sizes))
        extra = sorted(set(sizes) - set(columns))
        raise ValueError(
            f"mini_batch_size must have one entry per column: missing {missing}, not columns {extra}"
        )


def check_loss_kwargs(columns: Columns, loss_kwargs: Mapping[str, object]) -> None:
    """Batch-first tensors in ``loss_kwargs`` must match the rows of ``columns`` (``same_batch_size``;
    ``columns`` already checked by :func:`check_columns`)."""
    batch_size = rows_of(next(iter(columns.values())))
    for name, value in loss_kwargs.items():
        if isinstance(value, Tensor) and value.ndim >= 1 and value.shape[0] != batch_size:
            raise ValueError(
                f"loss keyword {name!r} has {value.shape[0]} rows but the columns have {batch_size} "
                "(per-example loss inputs are batch-first)"
            )


def check_token_ids(columns: Columns, encoder: Callable[..., Tensor]) -> None:
    """Raise ValueError naming the column when its ``input_ids`` fall outside the encoder's vocabulary.

    The vocabulary is the number of rows of the input embeddings of the transformers models inside the
    encoder (``get_input_embeddings()``; the largest if there are several); an encoder without one is
    not checked. An id outside it would otherwise fail inside the embedding lookup, naming nothing (on
    CPU), or end the CUDA context with a device-side assert. One device sync for all columns.
    """
    vocab_size = _input_vocab_size(encoder)
    named = {
        column: ids
        for column, features in columns.items()
        if isinstance(ids := features.get("input_ids"), Tensor)
        and ids.numel()
        and not ids.is_floating_point()
    }
    if vocab_size is None or not named:
        return
    # [columns, 2] (min, max) on the columns' one device, read back at once.
    bounds = torch.stack([torch.stack([ids.min(), ids.max()]).to(torch.int64) for ids in named.values()])
    for column, (low, high) in zip(named, bounds.tolist(), strict=True):
        if low < 0 or high >= vocab_size:
            raise ValueError(
                f"column {column!r} has input_ids from {low} to {high}, but the encoder's vocabulary (its input "
                f"embeddings) has {vocab_size} entries, ids 0 to {vocab_size - 1}: was it tokenized with "
                "another model's tokenizer?"
            )


def check_autograd_inputs(columns: Columns) -> None:
    """Raise ValueError naming the column and feature for a tensor made under ``torch.inference_mode()``,
    which Step (3)'s re-encoding, inside the backward, cannot use in autograd. For steps that will backprop."""
    for column, features in columns.items():
        for name, value in features.items():
            if isinstance(value, Tensor) and value.is_inference():
                raise ValueError(
                    f"feature {name!r} of column {column!r} was created under torch.inference_mode(), and the "
                    "cached loss needs autograd: Step (3) re-encodes it inside loss.backward(). Create the batch "
                    "outside inference_mode (torch.no_grad() is fine) or pass value.clone() made outside it"
                )


def check_graphable(columns: Columns, encoder_devices: tuple[int, ...]) -> None:
    """``cuda_graphs``: every input and the encoder on one and the same CUDA device."""
    devices = {t.device for features in columns.values() for t in features.values()}
    if len(encoder_devices) != 1 or devices != {torch.device("cuda", encoder_devices[0])}:
        found = ", ".join(sorted(map(str, devices)))
        raise ValueError(
            "cuda_graphs=True needs the encoder's parameters and every column's tensors on one CUDA device; "
            f"the encoder is on CUDA devices {list(encoder_devices)}, the columns on {found}"
        )


def _check_one_device(columns: Columns) -> None:
    # Every tensor of every column on one device (the encoder's, which the columns' tensors go into together).
    devices = {
        column: sorted({str(value.device) for value in features.values() if isinstance(value, Tensor)})
        for column, features in columns.items()
    }
    for column, found in devices.items():
        if len(found) > 1:
            placed = {name: str(value.device) for name, value in columns[column].items()}
            raise ValueError(f"the features of column {column!r} are on different devices: {placed}")
    if len({tuple(found) for found in devices.values()}) > 1:
        placed = ", ".join(f"{column!r} on {found[0]}" for column, found in devices.items())
        raise ValueError(
            f"the columns are on different devices ({placed}): move every column to the encoder's device"
        )


def _input_vocab_size(encoder: Callable[..., Tensor]) -> int | None:
    """The largest input-embedding size among the transformers models inside ``encoder`` (None: none found)."""
    if not isinstance(encoder, nn.Module):
        return None
    sizes = []
    for module in encoder.modules():
        get_input_embeddings = getattr(module, "get_input_embeddings", None)
        if not callable(get_input_embeddings):
            continue
        try:
            embeddings = get_input_embeddings()
        except (AttributeError, NotImplementedError):  # a model class without input embeddings
            continue
        size = getattr(embeddings, "num_embeddings", None)
        if isinstance(size, int):
            sizes.append(size)
    return max(sizes) if sizes else None


# --------------------------------------------------------------------------------------------- outputs


def check_rep(rep: object, column: str, rows: Rows, reference: Tensor | None) -> None:
    """A Step (1) mini-batch's reps: a Tensor with the batch first, of the width, dtype and device of
    ``reference`` ([0, V] like the column's earlier reps; None for its first mini-batch)."""
    if not isinstance(rep, Tensor):
        raise TypeError(f"encoder must return a Tensor [B, V], got {type(rep).__name__} (column {column!r})")
    expected = row_count(rows)
    if rep.ndim < 1 or rep.shape[0] != expected:
        raise ValueError(
            f"encoder returned shape {tuple(rep.shape)} for {expected} rows of column {column!r}; "
            "expected the batch dimension first"
        )
    if reference is not None and (
        rep.shape[1:] != reference.shape[1:] or rep.dtype != reference.dtype or rep.device != reference.device
    ):
        raise ValueError(
            f"encoder returned {list(rep.shape[1:])} {rep.dtype} on {rep.device} for {describe_rows(rows)} of "
            f"column {column!r} but {list(reference.shape[1:])} {reference.dtype} on {reference.device} "
            "for its earlier rows: every mini-batch of a column must give reps of one width, dtype and device"
        )


def check_loss_output(result: object) -> LossOutput:
    """``loss_fn``'s result as (loss, components), checked: a scalar floating loss with a graph while
    gradients are enabled, and a dict of tensor components (detached here, for logging)."""
    if isinstance(result, tuple):
        if len(result) != 2 or not isinstance(result[1], Mapping):
            raise TypeError(
                "loss_fn must return a scalar Tensor or a tuple (scalar Tensor, dict of component "
                f"Tensors), got a tuple of length {len(result)}"
            )
        loss, components = result
    else:
        loss, components = result, {}
    if not isinstance(loss, Tensor) or not loss.is_floating_point():
        kind = f"a {loss.dtype} Tensor" if isinstance(loss, Tensor) else type(loss).__name__
        raise TypeError(f"loss_fn must return a floating-point scalar Tensor, got {kind}")
    if loss.ndim != 0:
        raise ValueError(f"loss_fn must return a scalar (0-dim) Tensor, got shape {tuple(loss.shape)}")
    for name, value in components.items():
        if not isinstance(value, Tensor):
            raise TypeError(f"loss component {name!r} must be a Tensor, got {type(value).__name__}")
    if torch.is_grad_enabled() and not loss.requires_grad:
        raise ValueError("loss_fn's loss does not depend on the reps (it has no graph)")
    return LossOutput(loss, {name: value.detach() for name, value in components.items()})


def check_replayed_rep(rep: object, grad: Tensor, column: str, rows: Rows) -> None:
    """A Step (3) mini-batch's reps: with a graph, and of the shape and dtype of its gradient."""
    if not isinstance(rep, Tensor) or not rep.requires_grad:
        raise RuntimeError(
            f"the replayed rep (column {column!r}, {describe_rows(rows)}) does not require grad: the encoder "
            "ran without autograd (is it left under torch.no_grad(), or are all its parameters frozen?)"
        )
    if rep.shape != grad.shape or rep.dtype != grad.dtype:
        raise RuntimeError(
            f"the replayed rep (column {column!r}, {describe_rows(rows)}) is {tuple(rep.shape)} {rep.dtype} "
            "but Step (1) produced "
            f"{tuple(grad.shape)} {grad.dtype}: the encoder is not deterministic given RNG and autocast state"
        )


_NON_FINITE_HINT = (
    ". If a GradScaler is in charge (fp16), pass allow_non_finite=True so it can skip the step."
)


def raise_if_non_finite(
    tensors: Mapping[str, Tensor],
    components: Mapping[str, Tensor] | None = None,
    *,
    every_rank: torch.device | None = None,
) -> None:
    """Raise FloatingPointError naming the tensors (and loss components) that hold a NaN or an infinity.

    One device sync for all. With ``every_rank`` (data parallelism: the device of the collective), the
    ranks agree first, so that all raise when one would: a rank raising alone would leave the others
    waiting in their synchronising backward.
    """
    flags = [torch.isfinite(t).all() for t in tensors.values()]
    if every_rank is not None:  # every rank joins the collective, also one with nothing to check
        finite_here = (
            torch.stack([flag.to(every_rank) for flag in flags]).all()
            if flags
            else torch.ones((), dtype=torch.bool, device=every_rank)
        )
        if holds_on_every_rank(finite_here, every_rank):
            return
        if bool(finite_here):
            raise FloatingPointError(
                "non-finite rep gradients on another rank; stopping before Step (3) on every rank"
                + _NON_FINITE_HINT
            )
    if not flags:
        return
    finite = torch.stack([flag.to(flags[0].device) for flag in flags]).cpu().tolist()
    if all(finite):
        return
    bad = [name for name, ok in zip(tensors, finite, strict=True) if not ok]
    message = f"non-finite values in {', '.join(bad)}; stopping before Step (3)"
    if components:
        bad_components = [name for name, value in components.items() if not torch.isfinite(value).all()]
        message += f" (non-finite loss components: {bad_components or 'none'})"
    raise FloatingPointError(message + _NON_FINITE_HINT)


# ------------------------------------------------------------------------------------ the replay check


def fingerprint(rep: Tensor) -> Tensor:
    """[mb, ...] -> [mb]: each row's fp32 sum, a cheap digest equal bit for bit for bitwise-equal reps.

    Computed the same way in Step (1) and Step (3): one layout (so one summation order), no graph,
    and outside autocast (CUDA autocast would cast the input to fp32 first, another kernel).
    """
    rows = rep.detach().contiguous().view(rep.shape[0], math.prod(rep.shape[1:]))  # [mb, ...] -> [mb, V]
    with torch.no_grad(), torch.autocast(rep.device.type, enabled=False):
        return rows.sum(dim=1, dtype=torch.float32)  # [mb, V] -> [mb]


def fingerprints_differ(replayed: Tensor, first: Tensor) -> Tensor:
    """A 0-dim bool on the device: whether two fingerprints differ as bits (NaN, under
    ``allow_non_finite``, equals itself, and -0.0 differs from 0.0)."""
    return (replayed.view(torch.int32) != first.view(torch.int32)).any()


def raise_if_not_reproduced(checked: Sequence[tuple[str, MiniBatch]], differs: Sequence[Tensor]) -> None:
    """Raise RuntimeError naming the mini-batches whose replay differed from Step (1) (one device sync)."""
    if not differs:
        return
    flags = torch.stack([flag.to(differs[0].device) for flag in differs]).tolist()
    bad = [
        f"column {column!r} {describe_rows(mb.rows)}"
        for (column, mb), flag in zip(checked, flags, strict=True)
        if flag
    ]
    if not bad:
        return
    rebuilt = any(mb.memo is not None for _, mb in checked)
    raise RuntimeError(
        f"GradCache Step (3) did not reproduce Step (1): the replayed reps of {len(bad)} of {len(checked)} "
        f"mini-batches differ from the reps the loss saw ({'; '.join(bad[:3])}{'; ...' if len(bad) > 3 else ''}), "
        + (
            "as the Sparton head's inputs show (reuse_argmax: its hidden states, weight or bias are not "
            "Step (1)'s), "
            if rebuilt
            else ""
        )
        + "so their gradients would belong to another function. Likely causes: the encoder's train/eval "
        "mode changed between the forward and the backward (model.eval() or model.train() in between); "
        "parameters were modified in place between the forward and the backward (e.g. optimizer.step() "
        "before loss.backward()); randomness the engine does not replay (Python's `random`, NumPy, a "
        "torch.Generator of the encoder's own: only torch's default CPU generator and the default "
        "generators of the CUDA devices in use are replayed). For an encoder that is legitimately not "
        "deterministic, pass check_replay=False."
    )


# ------------------------------------------------------------------------------------- failure notes


def encode_failure_note(encoder: Callable[..., Tensor], column: str, rows: Rows, features: Features) -> str:
    """Where Step (1) failed, and the devices when the inputs are not where the encoder's parameters are."""
    note = f"GradCache Step (1) failed encoding column {column!r} ({describe_rows(rows)})"
    inputs = sorted({str(value.device) for value in features.values()})
    if isinstance(encoder, nn.Module):
        parameters = sorted({str(p.device) for p in encoder.parameters()})
        if parameters and not set(inputs) <= set(parameters):
            note += f"; its inputs are on {', '.join(inputs)}, the encoder's parameters on {', '.join(parameters)}"
    return note


def replay_failure_note(where: tuple[int, int, str, Rows] | None, *, done: int, restored: bool) -> str:
    """Where Step (3) failed (``where``: replayed mini-batch index, their count, its column and rows; None
    after all ``done`` were replayed) and whether ``.grad`` was restored."""
    if where is not None:
        index, total, column, rows = where
        place = f"in replayed mini-batch {index + 1} of {total} (column {column!r}, {describe_rows(rows)})"
    else:
        place = f"after replaying all {done} mini-batches"
    if not restored:
        return (
            f"GradCache Step (3) failed {place}; the encoder is not an nn.Module, so its gradients could not "
            "be restored: .grad may hold the mini-batches replayed before the failure (zero it before retrying)"
        )
    return (
        f"GradCache Step (3) failed {place}; the encoder's .grad was restored to what it was before the step"
    )
