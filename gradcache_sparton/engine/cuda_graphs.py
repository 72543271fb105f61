"""CUDA graphs over bucketed mini-batch shapes: each Step (1) and Step (3) mini-batch as one graph launch.

At small mini-batches a GradCache step is bound by the host: an eager BERT forward issues hundreds of
kernels, each a few microseconds of Python and dispatch, and the device idles between them
(docs/benchmarks.md measured 0.25 of the step busy at 16 rows). :class:`GraphedEncoder` records, per
mini-batch shape, two CUDA graphs and replays them instead:

- Step (1): the encoder's forward without autograd, ``features -> rep [mb, V]``;
- Step (3): the forward with autograd and the backward of the mini-batch's rep gradient, which
  accumulates into the parameters' ``.grad``.

A shape is the features' shapes and dtypes, the encoder's train/eval mode and the autocast state;
``GradCacheConfig.mini_batch_length_multiple`` keeps the mini-batch lengths to a few values, so few graphs are
recorded. Each is recorded the first time its shape comes: one eager warm-up run (Triton's compile and
autotuning, cuBLAS's workspaces), then the capture, then the replay that computes the mini-batch.

Why it is exact:

- Dropout: a graph draws from the default CUDA generator at the offset it holds when the graph is
  replayed, advanced by what each kernel consumes as in eager execution, so a graph replayed from a
  mini-batch's captured RNG state draws what the eager forward would. Step (1)'s and Step (3)'s graphs
  run the same forward kernels: Step (3) reproduces Step (1) bit for bit, which the engine's
  ``check_replay`` proves on every step.
- Gradients: the Step (3) graph computes the parameters' gradients (``torch.autograd.grad`` over
  fresh leaves sharing their memory, so no accumulator of the parameters themselves is involved) and
  adds them into fixed addresses: each parameter that receives a gradient gets one ``.grad`` tensor
  for the graphs' lifetime. Before Step (3) it becomes the parameter's ``.grad``:
  zeroed when ``.grad`` was None (the optimizer's ``zero_grad(set_to_none=True)``), or holding a copy
  of the gradient found there. Parameters that receive no gradient keep ``.grad`` None, as without
  graphs (an optimizer skips them).
- Autocast: recorded with autocast's weight-cast cache off, so every graph casts the weights itself
  (a cached cast would be memory of one graph read by another).

Memory: every graph records into one shared pool, so the activations of one mini-batch are held once,
not once per shape (the mini-batches run one after another). Held between steps: the pool (about one
mini-batch's activations), one ``.grad``-sized tensor per trained parameter, and each graph's inputs
and [mb, V] output.

Also recorded: non-reentrant activation checkpointing (the recomputation, RNG state included, is part
of the Step (3) graph) and a ``torch.compile``'d encoder (its kernels are compiled in the warm-up run;
run it with ``check_replay=False``, as for any compiled encoder). Both are tested against the eager
engine on a GPU.

Not supported (refused by :class:`~gradcache_sparton.engine.GradCacheConfig` and the engine with a clear error): data
parallelism (DDP's gradient hooks communicate), ``reuse_argmax`` (host-side records), token-budget
mini-batches (a row count per mini-batch: too many shapes); reentrant activation checkpointing (refused
when the first Step (3) graph is recorded). The encoder must run on one CUDA device and issue no host
sync in its forward or backward (transformers' models do not when captured).

Legend: mb mini-batch rows, S sequence, V rep width.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from gradcache_sparton.engine.argmax_reuse import ArgmaxMemo
from gradcache_sparton.engine.autocast_state import AutocastState
from gradcache_sparton.engine.checks import check_graphable
from gradcache_sparton.engine.mini_batch import Rows
from gradcache_sparton.engine.rng_state import RngState, cuda_devices_of
from gradcache_sparton.engine.types import Columns, Features, MiniBatch

__all__ = ["GraphRun", "GraphedEncoder", "recording_stream"]

# (feature name, shape, dtype) per feature, the encoder's training flag, the autocast settings.
ShapeKey = tuple[tuple[tuple[str, tuple[int, ...], torch.dtype], ...], bool, tuple[object, ...]]


@dataclass
class _Graph:
    """One recorded graph: static inputs it reads, the static rep it writes (and, for Step (3), the
    static rep gradient it backpropagates)."""

    graph: torch.cuda.CUDAGraph
    inputs: dict[str, Tensor]
    rep: Tensor  # [mb, V]
    rep_grad: Tensor | None  # [mb, V], Step (3) graphs only

    def run(self, features: Mapping[str, Tensor], rep_grad: Tensor | None = None) -> Tensor:
        for name, value in features.items():
            self.inputs[name].copy_(value)
        if self.rep_grad is not None:
            assert rep_grad is not None
            self.rep_grad.copy_(rep_grad)
        self.graph.replay()
        return self.rep


class GraphedEncoder:
    """An ``nn.Module`` encoder's mini-batches replayed as CUDA graphs, one pair per mini-batch shape.

    :meth:`encode` is Step (1) for one mini-batch (returns a fresh [mb, V] tensor), :meth:`replay` is
    Step (3) for one (accumulates into ``.grad``; call :meth:`attach_grads` first). Call
    :meth:`check_parameters` before each step's first :meth:`encode` and first :meth:`replay`. Both run the
    mini-batch from its captured :class:`RngState` under the step's :class:`AutocastState`.

    The recordings belong to this object: the engine that built it (one per engine, kept across steps)
    replays them step after step.
    """

    def __init__(self, encoder: nn.Module) -> None:
        self.encoder = encoder
        self._pool: tuple[int, int] | None = None
        self._forward_graphs: dict[ShapeKey, _Graph] = {}
        self._backward_graphs: dict[ShapeKey, _Graph] = {}
        # Per trained parameter that receives a gradient: the .grad tensor the graphs add into.
        self._grads: dict[nn.Parameter, Tensor] = {}
        self._parameter_addresses: tuple[int, ...] = ()

    @property
    def graph_count(self) -> int:
        """How many graphs are recorded (Step (1) and Step (3) together)."""
        return len(self._forward_graphs) + len(self._backward_graphs)

    def check_parameters(self) -> None:
        """Drop every recording if the parameters moved or were replaced since (the graphs read their
        memory); called once per Step (1) and once per Step (3), not per mini-batch."""
        addresses = tuple(p.data_ptr() for p in self.encoder.parameters())
        if addresses != self._parameter_addresses:
            self._forward_graphs.clear()
            self._backward_graphs.clear()
            self._grads.clear()
            self._parameter_addresses = addresses

    def encode(self, features: Mapping[str, Tensor], rng: RngState, autocast: AutocastState) -> Tensor:
        """Step (1) for one mini-batch: its reps [mb, V] without autograd (a fresh tensor)."""
        key = self._key(features, autocast)
        graph = self._forward_graphs.get(key)
        if graph is None:
            graph = self._record(features, None, rng, autocast, self._forward_body)
            self._forward_graphs[key] = graph
        # The next replay of this graph overwrites its output: the caller keeps a copy.
        return graph.run(features).clone()

    def attach_grads(self) -> None:
        """Make each graphed parameter's ``.grad`` the tensor the graphs add into, keeping its value."""
        zeroed: list[Tensor] = []
        for parameter, grad in self._grads.items():
            if parameter.grad is None:
                zeroed.append(grad)
            elif parameter.grad is not grad:
                grad.copy_(parameter.grad)
            else:
                continue
            parameter.grad = grad
        if zeroed:
            torch._foreach_zero_(zeroed)

    def replay(
        self, features: Mapping[str, Tensor], rep_grad: Tensor, rng: RngState, autocast: AutocastState
    ) -> Tensor:
        """Step (3) for one mini-batch: forward and backward of ``rep_grad`` [mb, V] into ``.grad``.

        Call it inside ``rng.replay()`` (the graph draws from the generators' current state), after
        :meth:`attach_grads`. Returns the replayed reps [mb, V], valid until this shape is replayed again.
        """
        key = self._key(features, autocast)
        graph = self._backward_graphs.get(key)
        if graph is None:
            graph = self._record(features, rep_grad, rng, autocast, self._backward_body)
            self._backward_graphs[key] = graph
        return graph.run(features, rep_grad)

    # ------------------------------------------------------------------ recording

    def _key(self, features: Mapping[str, Tensor], autocast: AutocastState) -> ShapeKey:
        shapes = tuple((name, tuple(t.shape), t.dtype) for name, t in sorted(features.items()))
        return shapes, self.encoder.training, autocast.settings

    def _forward_body(self, inputs: dict[str, Tensor], rep_grad: Tensor | None, *, warm_up: bool) -> Tensor:
        with torch.no_grad():
            return self.encoder(**inputs)  # [mb, V]

    def _backward_body(self, inputs: dict[str, Tensor], rep_grad: Tensor | None, *, warm_up: bool) -> Tensor:
        assert rep_grad is not None
        trained = [(name, p) for name, p in self.encoder.named_parameters() if p.requires_grad]
        # Fresh leaves over the parameters' memory: their gradient accumulators are created here, on the
        # recording stream. The parameters' own may be held on another stream by a graph still alive
        # elsewhere (an eager loss kept in a variable), which a capture cannot wait on.
        leaves = {name: p.detach().requires_grad_() for name, p in trained}
        with torch.enable_grad():
            rep = torch.func.functional_call(self.encoder, leaves, args=(), kwargs=inputs)  # [mb, V]
        if rep.shape != rep_grad.shape or rep.dtype != rep_grad.dtype or not rep.requires_grad:
            raise RuntimeError(
                f"the encoder's replayed reps ({tuple(rep.shape)}, {rep.dtype}, requires_grad="
                f"{rep.requires_grad}) do not match their gradient ({tuple(rep_grad.shape)}, {rep_grad.dtype})"
            )
        if warm_up and _reentrant_checkpoint_in(rep):
            raise ValueError(
                "cuda_graphs=True cannot record reentrant activation checkpointing (torch.utils.checkpoint "
                "with use_reentrant=True): enable it with use_reentrant=False (transformers' default, e.g. "
                "gradient_checkpointing_kwargs={'use_reentrant': False}) or run without cuda_graphs"
            )
        grads = torch.autograd.grad(rep, list(leaves.values()), rep_grad, allow_unused=True)
        flowing = [(p, grad) for (_, p), grad in zip(trained, grads, strict=True) if grad is not None]
        if warm_up:  # which parameters the graph adds into (the others keep .grad None)
            for parameter, _ in flowing:
                if parameter not in self._grads:
                    self._grads[parameter] = torch.zeros_like(parameter)
        else:
            torch._foreach_add_([self._grads[p] for p, _ in flowing], [grad for _, grad in flowing])
        return rep.detach()

    def _record(
        self,
        features: Mapping[str, Tensor],
        rep_grad: Tensor | None,
        rng: RngState,
        autocast: AutocastState,
        body: Callable[..., Tensor],
    ) -> _Graph:
        """Warm up, then capture ``body`` on static copies of the inputs; the global RNG streams and
        ``.grad`` values are left as they were."""
        device = next(iter(features.values())).device
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = recording_stream(device)
        inputs = {name: value.clone() for name, value in features.items()}
        static_grad = None if rep_grad is None else rep_grad.clone()
        with rng.replay():
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side), autocast.replay(cache_enabled=False):
                body(inputs, static_grad, warm_up=True)
            torch.cuda.current_stream(device).wait_stream(side)
        if rep_grad is not None:
            self.attach_grads()  # the tensors the capture adds into, now each parameter's .grad
        graph = torch.cuda.CUDAGraph()
        try:
            with (
                rng.replay(),
                torch.cuda.graph(graph, pool=self._pool, stream=side),
                autocast.replay(cache_enabled=False),
            ):
                rep = body(inputs, static_grad, warm_up=False)
        except RuntimeError as error:
            if "captur" not in str(error):
                raise
            raise RuntimeError(
                "recording a CUDA graph of the encoder failed (cuda_graphs=True): its forward or backward "
                "syncs with the host (.item(), a check on tensor values, a data-dependent shape) or uses "
                "another stream; run it without cuda_graphs"
            ) from error
        return _Graph(graph=graph, inputs=inputs, rep=rep, rep_grad=static_grad)


class GraphRun:
    """Running each mini-batch as CUDA graph launches (``cuda_graphs``), with the recordings of one
    :class:`GraphedEncoder` kept for the engine's lifetime; the same methods as
    :class:`~gradcache_sparton.engine.run_eager.EagerRun`."""

    def __init__(self, encoder: nn.Module) -> None:
        self.graphs = GraphedEncoder(encoder)

    def start_encode(self, columns: Columns) -> None:
        check_graphable(columns, cuda_devices_of(self.graphs.encoder.parameters()))
        self.graphs.check_parameters()

    def encode(
        self, column: str, rows: Rows, features: Features, rng: RngState, autocast: AutocastState
    ) -> tuple[Tensor, ArgmaxMemo | None]:
        return self.graphs.encode(features, rng, autocast), None  # [mb, V]

    def start_replay(self) -> None:
        self.graphs.check_parameters()
        self.graphs.attach_grads()  # after the engine captured .grad: a failure puts it back

    def replay(self, column: str, mb: MiniBatch, grad: Tensor | None, autocast: AutocastState) -> Tensor:
        assert grad is not None  # zero-gradient replays come with data parallelism only, which graphs refuse
        # Forward and backward in one graph launch.
        return self.graphs.replay(mb.features, grad, mb.rng, autocast)


def recording_stream(device: torch.device) -> torch.cuda.Stream:
    """The one stream that warms up and records every CUDA graph on ``device``: each stream a matmul runs
    on holds its own cuBLAS workspace, so one stream for all recordings holds one (which ``max_memory``'s
    plan measures on this same stream)."""
    return _stream_of(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _stream_of(index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(index)


def _reentrant_checkpoint_in(rep: Tensor) -> bool:
    """Whether ``rep``'s autograd graph holds a reentrant checkpoint. Its backward runs a nested
    ``backward()``: ``torch.autograd.grad`` refuses it, and a capture through ``backward()`` failed on an
    H200 (gradient accumulators on another stream)."""
    seen: set[torch.autograd.graph.Node] = set()
    stack = [rep.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        if node.name() == "CheckpointFunctionBackward":
            return True
        seen.add(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return False
