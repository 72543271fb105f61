"""The real-workload benchmark's harness: ours (GradCache + Sparton) vs sentence-transformers, one process.

The script ``benchmarks/bench_real_workload.py`` runs it (commands there); its modules, by job:
``workloads`` (real text, tokenized batches), ``models`` (the models both providers load, calibration),
``configs`` (one row's settings, the plan of a run), ``steps`` (each provider's training step),
``measure`` (timing a configuration, ``benchmarks/harness.py`` underneath), ``targets`` (issue 15's
ratios), ``report`` (tables, JSON, markdown, plot).

Legend: B batch (pairs), S sequence, D hidden, V vocabulary.

What one step is, for every provider: the same batch of ``--effective_batch`` (query, positive,
negative_1) triplets of real text, tokenized once with the bert-base-uncased tokenizer and padded to
each column's longest row (queries at most 64 tokens, passages at most 256), the same SPLADE loss
(InfoNCE over in-batch + hard negatives at temperature 1, FLOPS regularizers query 5e-4, doc 3e-4),
AdamW (lr 1e-5, fused on CUDA), bf16 autocast around the loss and its backward (fp32 on CPU), then
``optimizer.step()`` and ``zero_grad``. Providers, side by side:

  ours-mb<N>        ``CachedLoss(SpladeEncoder, SpladeLoss, mini_batch_size=N)`` (the Sparton head);
  ours+reuse-...    the same with ``reuse_argmax=True`` (``--reuse_argmax on`` or ``both``): the replay
                    rebuilds the head from Step (1)'s max and argmax instead of running its forward;
  ours+sparse-...   the same with ``sparse_reps=True`` (``--sparse_reps on`` or ``both``): Step (1) keeps
                    each column's reps as their non-zeros, not [B, V] (less memory for the cache);
  ours-tok<T>       the same with token-budget mini-batches of at most T tokens, when ``GradCache``
                    offers them (detected from its signature, ``mini_batch_tokens``; absent otherwise):
                    rows grouped by length, T bounds rows x the mini-batch's longest row;
  st-mb<N>          sentence-transformers' ``CachedSpladeLoss(SparseEncoder, SparseMultipleNegatives
                    RankingLoss(scale=1), document_regularizer_weight=3e-4, query_regularizer_weight=5e-4,
                    mini_batch_size=N)``; the SparseEncoder is ``Transformer(path, transformer_task=
                    "fill-mask")`` + ``SpladePooling("max")`` loaded from the same directory as ours;
  st-tok<T>         the same with ``mini_batch_num_tokens=T``: consecutive rows, T bounds their
                    non-padding tokens;
  ours-uncached     ``SpladeLoss({column: encoder(**features)})`` at the effective batch, halved until it
                    fits (each size tried is a row).

Backbone options, given to both providers alike (each provider runs once per setting):

  ...+ckpt          ``--checkpointing on|both``: activation checkpointing in the backbone (transformers'
                    ``activation_checkpointing_enable``, ``gradient_checkpointing_enable`` before 5.23;
                    non-reentrant): each layer's activations are recomputed in the backward, so a
                    memory budget holds larger mini-batches;
  ...+compile       ``--compile on|both``: the backbone's base model (the transformer stack) under
                    ``torch.compile(dynamic=True)`` (default mode: fused kernels, fewer launches per
                    encoder call); the head stays as it is (ours: the Sparton op; theirs: the MLM head
                    and SpladePooling). Ours runs it with ``check_replay=False``, as the trainer does
                    under ``torch_compile``; ours uncached is compiled too. Compilation falls in the
                    two warm-up steps (the row's ``warmup_s`` is the first). ``--compile_mode``
                    picks torch.compile's mode (``+compile-ro``: reduce-overhead, CUDA graphs; each
                    encoder call is then marked as a new iteration);
  ours+pad<m>-...   ``--mini_batch_length_multiple m``: ours rounds each mini-batch's length up to a multiple of
                    m (``GradCache(mini_batch_length_multiple=m)``; the same loss and gradients, a few shapes),
                    and a compiled backbone of ours is compiled with static shapes (dynamo's recompile
                    limit raised to 64). sentence-transformers has no such option: its compiled
                    backbone stays dynamic.
  ours+...+graphs   ``--cuda_graphs on|both`` (with ``--mini_batch_length_multiple``): ours replays each
                    mini-batch's Step (1), and its Step (3) forward and backward, as one CUDA graph per
                    mini-batch shape (``GradCache(cuda_graphs=True)``), recorded in the warm-up steps;
                    row budgets only, not with ``reuse_argmax``.

Token budgets T are the row budgets N times the workload's mean tokens per passage, rounded to 256, so
``mb32`` and ``tok<T>`` aim at about the same activation memory. Both providers get the identical
padded tensors; both trim each mini-batch's trailing padding.

Workloads (``--workloads``), built from the shipped SciFact sample
(``gradcache_sparton/resources/scifact_sample/train.jsonl.gz``, 3,204 pairs: a claim or a sentence of
an abstract -> the abstract; on average 231 tokens per abstract and 33 per query, [CLS] and [SEP]
included):

  scifact   query -> positive as shipped (abstract: title + text), negative_1 = another row's
            abstract (a fixed permutation of the rows; never the row's own positive);
  short     MS MARCO-like passages of 40-120 tokens: each positive and negative is a window of
            uniform-random length in [40, 120] tokens of an abstract, starting at a sentence start.

Models (``--models``):

  tiny      the pretrained SPLADE-tiny (BERT-tiny shape: D 128, 2 layers, V 30,522; reps ~99% zeros),
            from ``--model_path`` (default: the package's copy, else ../shared's; the model is skipped
            with a message when neither exists);
  base      BERT-base width (D 768, 12 heads, FFN 3,072, 6 layers, V 30,522), random init, with the
            decoder bias set so that the reps of real text have ``--target_density`` non-zeros (2%:
            trained SPLADE models have 1-3%). Calibrated in the script: with the bias at 0 the max over
            positions of each (row, term) logit is computed on a sample of every column of every
            workload, and the bias is minus its (1 - target) quantile (a rep entry is non-zero exactly
            when that max plus the bias is positive). The measured non-zeros per row are printed and
            recorded. The weights are saved to a temporary directory that both providers load.

Before timing, each model's reps from ours and from the SparseEncoder are compared on a few rows (eval
mode, fp32): the JSON records the largest difference (the same weights give the same function).

Measurement per configuration: a fresh model from the same initial weights and a fresh optimizer;
``torch.cuda.reset_peak_memory_stats`` before the first step; one warm-up step (two when it is cheap;
Triton compilation, AdamW state); then up to ``--steps`` timed steps, each on a different batch,
wall time between two ``torch.cuda.synchronize`` calls. A row reports the median's pairs/s (pairs per
step = effective batch), the peak ``torch.cuda.max_memory_allocated`` over all its steps (weights,
gradients and AdamW state included), for ours the mean non-zeros per row of each column (64 rows,
after its steps), and with
``--busy_fraction`` (CUDA; off by default) the device-busy fraction of one more step run under
``torch.profiler`` (sum of its kernel times over the median wall time; with ``--profile_host`` the
host's operators are recorded too and that step's operators by host time go to
``profile_<configuration>.txt``: slow at small mini-batches), and with ``--sync_audit`` (CUDA) the
host-device synchronisations of one more step, counted by call site (``torch.cuda.set_sync_debug_mode``);
with ``--cprofile`` (CUDA) one more step under cProfile, its table in ``cprofile_<configuration>.txt``.
A configuration that runs out
of memory is a row with status "OOM"; one not started within ``--time_budget_s`` is "skipped".

The targets of issue 15 are computed within each (model, workload): for memory budgets of 4 GiB,
8 GiB and unlimited, our best pairs/s and sentence-transformers' best among the rows that fit, and
their ratio; our best at 4 GiB over our best at 8 GiB; our best cached over our best uncached.
"""

__all__: list[str] = []
