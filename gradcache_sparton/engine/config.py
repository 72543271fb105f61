"""``GradCacheConfig``: every option of the GradCache engine, in one dataclass: what the user asks.

:class:`~gradcache_sparton.engine.GradCache` and :class:`~gradcache_sparton.engine.CachedLoss` take it
(or its fields as keywords, which build it), and the trainer's
:class:`~gradcache_sparton.arguments.CachedSpladeTrainingArguments` inherits it, so each field is also a
command-line flag and a YAML/JSON key with the help text below. ``__post_init__`` is the one place the
options are checked (a ``TypeError`` or ``ValueError`` naming the field) and put in one spelling; a field
left None is for the engine to decide, in one place:
:func:`~gradcache_sparton.engine.settings.resolve_settings` (and, for those ``max_memory`` plans, the planner,
which returns the same settings with its choices). Adding an engine option is one field here, its field in
``StepSettings`` and its decision there, and its use in the engine (docs/engine_options.md walks one).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gradcache_sparton.engine.memory_size import parse_max_memory
from gradcache_sparton.engine.option_rules import check_option_rules
from gradcache_sparton.primitives.option_field import option

__all__ = ["GradCacheConfig"]


@dataclass
class GradCacheConfig:
    """How the GradCache engine is to cut, run and check a batch, as asked. None: the engine decides
    (:func:`~gradcache_sparton.engine.settings.resolve_settings`, read back as ``GradCache.settings``).

    ``mini_batch_size`` may also be a mapping with one entry per column (e.g. short queries in larger
    mini-batches than long passages); the trainer's flags set it through ``mini_batch_size`` and
    ``query_mini_batch_size``.

    Automatic defaults (None): ``check_replay`` is on and ``reuse_argmax`` on where it is safe, except
    for a compiled encoder (``torch.compile``: its graph-less and graph-recording programs may round
    differently, and its head records nothing) and, for ``reuse_argmax``, under ``cuda_graphs``, which
    also rounds mini-batch lengths to multiples of 32 unless ``mini_batch_length_multiple`` is given (as
    for a compiled encoder); ``gather_across_ranks`` gathers when ``torch.distributed`` runs more than one
    rank.

    ``sparse_reps`` is ``"false"``, ``"true"`` or ``"auto"`` (a bool, or any case, is taken and written so),
    or None: left to ``max_memory``'s plan, else ``"false"``.

    ``max_memory`` (a size such as ``"4GiB"``, or ``"auto"``) lets the engine plan, on the first step, the
    options left unset (None): ``mini_batch_size``, ``cuda_graphs``, ``reuse_argmax``, ``sparse_reps``,
    ``keep_graphs`` and activation checkpointing (:mod:`~gradcache_sparton.engine.planner.memory_plan`). Without it
    the unset ones take the engine's defaults: 32 rows, no CUDA graphs, dense reps, no graphs kept.
    """

    mini_batch_size: int | dict[str, int | None] | None = option(
        None,
        "Rows encoded at once by the GradCache engine: bounds activation memory (that of one "
        "mini-batch), never changes the loss or gradients. Larger is faster until it no longer fits. "
        "Default: planned within max_memory when that is set, else 32.",
    )
    max_memory: str | None = option(
        None,
        "GPU memory budget of a training step, e.g. 4GiB, 512MiB, 24GB (units B, KB, MB, GB, TB and "
        "KiB, MiB, GiB, TiB), or auto (what the CUDA device has free at the start, less a tenth). On the first "
        "step a short measured probe picks what is left unset (mini_batch_size, cuda_graphs, reuse_argmax, "
        "activation checkpointing, sparse_reps) for the fastest step whose peak stays within it; explicit "
        "settings are kept; the loss and gradients never change. Bounds the memory the process reserves "
        "(torch.cuda.max_memory_reserved, CUDA graphs' pools included), hence also what it allocates. "
        "CUDA only (on a CPU a size is ignored with a warning, auto quietly; under DDP / FSDP auto is "
        "ignored and a size refused). 'none': no plan.",
    )
    mini_batch_tokens: int | None = option(
        None,
        "Also bound each mini-batch by padded tokens (rows x its longest row): each column's rows "
        "are taken longest first and packed under this budget, saving the padding of mixed lengths; the "
        "reps are put back in order, so the loss and gradients do not change (up to fp32 summation "
        "order). Needs a 2-D attention_mask in every column. Default: rows only (mini_batch_size).",
    )
    mini_batch_length_multiple: int | None = option(
        None,
        "Round each mini-batch's length (its longest row) up to a multiple of this, within the "
        "batch's padding: mini-batches then come in a few shapes (at most ceil(S / m) + 1 lengths per "
        "column), which a compiled encoder with static shapes and cuda_graphs need; the loss and "
        "gradients are unchanged. Default: each mini-batch is cut to its longest row; 32 under cuda_graphs and "
        "for a compiled encoder (torch_compile).",
    )
    same_batch_size: bool = option(
        True,
        "Require every column, and every batch-first tensor among the loss's inputs, to have the "
        "same number of rows, checked before any encoding (what contrastive losses need).",
    )
    allow_non_finite: bool = option(
        False,
        "Let a non-finite loss or rep gradient through instead of stopping with "
        "FloatingPointError: for when a GradScaler (fp16) is in charge, which then skips the step and "
        "lowers its scale, as in uncached training.",
    )
    show_mini_batch_progress: bool = option(False, "Show a tqdm bar over the mini-batches of each step.")
    gather_across_ranks: bool | None = option(
        None,
        "Compute the loss on every process's reps (the global batch: in-batch negatives across "
        "processes), with gradients equal to one process training on it. Default: when torch.distributed "
        "runs more than one process; false: each process's loss sees its own rows only.",
    )
    check_replay: bool | None = option(
        None,
        "Prove on every step that the replay reproduced the first pass (a bitwise fingerprint of "
        "each mini-batch's reps, read back once per step) and stop with an error naming the likely causes "
        "if not. Default: on, except for a compiled encoder (torch_compile), whose graph-less and "
        "graph-recording programs may round differently.",
    )
    sparse_reps: str | None = option(
        None,
        "Keep each step's reps as their non-zeros (ids and weights) from the first pass to the "
        "replay, instead of dense [batch, vocabulary] reps and gradients: memory grows with the non-zeros "
        "rather than batch x vocabulary, which lets trained (sparse) models take far larger batches; the "
        "loss and gradients are the dense path's up to fp32 summation order. Exact for encoders whose "
        "gradient is zero wherever a rep is zero (a SPLADE head's relu; not checked). 'true': always; "
        "'auto': each step, when the first mini-batch's non-zeros take fewer bytes than its dense reps "
        "(below ~1/2 density in fp32; on every process alike); 'false': dense reps. The loss must accept "
        "sparse reps (SpladeLoss does). 'auto' costs one device sync per step. Default: false, unless "
        "max_memory is set and its plan fits only with sparse reps, or would otherwise need activation "
        "checkpointing: it then keeps them sparse ('true'; give false for a loss that takes dense reps only).",
        metavar="{false,true,auto}",
    )
    reuse_argmax: bool | None = option(
        None,
        "Skip the SPLADE head's forward in the replay: the first pass records the head's max and "
        "argmax over the sequence where its gradient can be non-zero (12 bytes per such entry, about one per "
        "non-zero rep entry), and the replay rebuilds the head's output and gradient from them, bit for bit. "
        "Saves the head's hidden x vocabulary product once per step (measured: 1.71x faster steps on a 2-core "
        "CPU in the default run's setting, 1.01-1.06x on an H100 at 64-256 rows; docs/benchmarks.md). "
        "Default: on where it is safe (not for a compiled encoder, whose head records nothing, nor under "
        "cuda_graphs); an encoder that records nothing (no Sparton head) runs without it.",
    )
    keep_graphs: bool | None = option(
        None,
        "Keep each mini-batch's graph from the first pass and backpropagate it in the replay instead of "
        "encoding it again: that mini-batch's step is an uncached one (one forward instead of two), for "
        "activation memory that grows with the rows kept. The loss and gradients do not change (the same "
        "forward, dropout included). true: every mini-batch (an uncached step, with the engine's checks); "
        "false: none. Not under data parallelism or cuda_graphs. Default: planned within max_memory when "
        "that is set (as many of each column's mini-batches as fit beside the rest of the step), else off.",
    )
    cuda_graphs: bool | None = option(
        None,
        "Replay each mini-batch's first pass, and its replay's forward and backward, as one CUDA graph "
        "per mini-batch shape: removes the host's per-kernel cost, which bounds small mini-batches (measured "
        "on an H100: 2.50x the pairs/s at 16 rows, 1.72x at 32; docs/benchmarks.md). The loss and gradients "
        "are those without graphs. Needs an nn.Module encoder on one CUDA device and no data parallelism; "
        "not with mini_batch_tokens or reuse_argmax (its default turns off); mini_batch_length_multiple "
        "defaults to 32 here (few shapes). Default: planned within max_memory when that is set, else off.",
    )

    def __post_init__(self) -> None:
        self.max_memory = parse_max_memory(self.max_memory)
        self._check_sizes()
        for name in ("same_batch_size", "allow_non_finite", "show_mini_batch_progress"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        for name in ("gather_across_ranks", "check_replay", "reuse_argmax", "keep_graphs", "cuda_graphs"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise TypeError(f"{name} must be a bool or None, got {type(value).__name__}")
        # One spelling: "false", "true" or "auto" (a bool, or any case, as a YAML file or a caller may give it).
        value = self.sparse_reps
        if value is not None:
            choice = str(value).lower() if isinstance(value, (bool, str)) else None
            if choice not in ("false", "true", "auto"):
                raise ValueError(f"sparse_reps must be one of false, true, auto, got {value!r}")
            self.sparse_reps = choice
        check_option_rules(self)  # the rules between options (the encoder's part: when the engine is built)

    def _check_sizes(self) -> None:
        if isinstance(self.mini_batch_size, Mapping):
            if not self.mini_batch_size:
                raise ValueError(
                    "mini_batch_size must be an int or a mapping with one entry per column, got {}"
                )
            self.mini_batch_size = dict(self.mini_batch_size)
            named = [(f"mini_batch_size[{column!r}]", size) for column, size in self.mini_batch_size.items()]
        else:
            named = [("mini_batch_size", self.mini_batch_size)]
        named = [(where, size) for where, size in named if size is not None]
        for name in ("mini_batch_tokens", "mini_batch_length_multiple"):
            if getattr(self, name) is not None:
                named.append((name, getattr(self, name)))
        for where, size in named:
            if isinstance(size, bool) or not isinstance(size, int):
                raise TypeError(f"{where} must be an int, got {type(size).__name__}")
            if size < 1:
                raise ValueError(f"{where} must be >= 1, got {size}")

    def mini_batch_sizes(self, columns: Mapping[str, object]) -> dict[str, int | None]:
        """Each column's mini-batch size as asked (``columns`` checked against a mapping by the engine's
        checks); None where the engine decides (``max_memory``'s plan, else its default)."""
        if isinstance(self.mini_batch_size, Mapping):
            return {column: self.mini_batch_size.get(column) for column in columns}
        return dict.fromkeys(columns, self.mini_batch_size)
