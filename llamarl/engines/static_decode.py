"""A decode step with static shapes, captured once per batch bucket as a CUDA graph and replayed for
the engine's life: the native engine's path on CUDA, where a step is bound by the host.

Why: eager HF modules are bound by the host on a GPU (Python and one launch per op, for a
fraction of that in device work; docs/gpu.md). gpt-fast, nano-vllm and vLLM remove that the same
way: every tensor a step touches has a fixed shape and address, so the step can be captured once
and replayed with one launch per step (and, opt-in, compiled first: ``torch.compile``, one graph,
no graph breaks). A replayed small model is then bound by the number of kernels in the graph, so
the step is written in few of them (llamarl/engines/static_step.py: 9 kernels a layer with the
fused Triton kernels of llamarl/engines/step_kernels.py, chosen on CUDA; 12 with aten ops).

* **Static state** (``StaticState``): per layer a KV cache ``[2, slots, kv_heads, width, head_dim]``
  (keys, then values) allocated once per decoder (slots rounded up to a bucket, width to a power of two >= 64;
  below), each row's positions left-aligned
  (position = column); the token each slot feeds next and its position live in device buffers
  ``tokens`` / ``positions``. What a row sees is computed in the graph from its position
  (``column <= position``): no mask tensor, no per-step concatenation.
* **Batch buckets**: a step runs the first ``rows`` slots, ``rows`` a rung of the ladder 1, 2, 4,
  8, 16, then steps of 16 (of 8 from 64 to 128 rows: ``bucket``);
  each bucket is one captured graph on CUDA (compiled first, when asked, by a compile that serves
  every bucket: dynamo's automatic dynamic shapes recompile once, with the rows symbolic, at
  the second bucket instead of once per bucket). Slots of
  finished or empty rows inside the bucket compute garbage that nothing reads (their writes go
  to their own slot); the decode loop (llamarl/engines/decode_loop.py) compacts rows into a
  smaller bucket when they fit.
* **The forward** (``static_step.static_forward``) is HF's math for Llama, Qwen2, Mistral,
  Qwen3 (q/k norms) and Gemma2 (its ``1 + weight`` norms around each block, soft-capped scores
  and logits: ``static_step.StepShape``; its sliding windows as long as the state) over the model's own parameters (norm weights, projections, MLP, LM head),
  q / k / v and gate / up each one GEMM over a buffer whose slices the model's parameters are
  (``static_step.fuse_projections``, at the first ``reserve``), so in-place weight updates and
  LoRA merges are read by the next step. fp32 matches HF to fp32 rounding, bf16 to a bf16
  rounding per op. RoPE's cos / sin come from the model's own rotary module, evaluated once per
  state for every column.

* **Attention over live columns** (issue 45 item 3). With the fused kernels (CUDA with Triton:
  llamarl/engines/step_kernels.py) the attention kernel reads each row's own columns ``0 ..
  position`` and nothing past them, so the step runs at the state's width, one graph per bucket
  (``attention_span`` returns the width, reading nothing). With the aten kernels (``span_rung``) a step attends the first
  ``span`` columns of the cache only, ``span`` the bucket's longest live KV over the next steps
  rounded up to a rung (multiples of 64 up to 1024, then eight rungs an octave), chosen by the
  decode loop at its looks (``attention_span``: one host read there, none between). The
  attention's work is ``rows x span``: it follows the live tokens, not the state's width (doubling
  the width at the same live lengths changes nothing: tests/test_live_attention.py), per bucket:
  a bucket's rows all read its longest row's span. Why a Triton kernel, not FlexAttention: its
  block mask skips per row too, but needs ``torch.compile`` to run fast and be captured, which the
  eager captured step does not assume; the kernel runs on the CPU under Triton's interpreter.

Graphs for the engine's life (nano-vllm's and vLLM's scheme): the state (KV cache, fed tokens and
positions, RoPE tables) is allocated once per decoder, at the capacity and width the calls need
(``reserve``: grown, and its graphs dropped, only when a call needs more slots or columns), and on
CUDA each (bucket, span) pair is captured at its first step, as a plain CUDA graph of the eager
step (no ``torch.compile`` unless asked: ``compiled=True``): at most 40 buckets up to 512 rows x
the spans a run reaches (16 up to 1024 columns, 8 an octave past that), the few a call uses
captured in its first steps. The graphs are replayed across ``generate`` calls and weight
versions: they hold the parameters' addresses, so a weight update must write into the same
storage (an in-place copy, as llamarl/models/weight_copy.py does); a rebound parameter (another
tensor at another address) is detected at the next ``reserve``, put back into its fused buffer if
it is a projection's, and the state is captured again. The graphs of one state share one memory
pool that lives exactly as long as they do (``StaticState.release`` drops both): a pool handle is
never used to capture after the graphs holding it have died (the first GPU runs crashed doing
that: ``CUDACachingAllocator`` asserts ``use_count > 0``).

Capturing a graph runs the step twice on a side stream (the allocator warm, any lazy init done),
then captures it. The forward is idempotent for a row (it writes its token's keys and values at
its own position, from the same inputs, and attends columns up to that position); a step that also
samples (``step(sampling=...)``: the draw and the books in the graph, static_sampling.py) advances
its rows, so the fed tokens, positions and liveness are saved before the warm-up runs and put back
after them and after the capture: mid-decode, a capture changes nothing a replay does not write again.
"""

from __future__ import annotations

import contextlib
import time
import types

import torch
from torch.distributed.tensor import DTensor

from llamarl.engines.base import SamplingParams
from llamarl.engines.kv_slots import KVSlots
from llamarl.engines.static_sampling import FIRST_CANDIDATES, SlotRecords, restore, sampling_key
from llamarl.engines.static_shapes import bucket, ladder, span_rung, state_width  # noqa: F401 - re-exported
from llamarl.engines.static_step import fuse_projections, reproduces, rope_tables, static_forward
from llamarl.engines.step_kernels import KERNEL_SETS, choose_kernels

_SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM")
# One compiled graph per (bucket, span) pair of one model at most (dynamo's automatic dynamic shapes
# make the rows symbolic at the second bucket): 40 buckets up to 512 rows x the spans
# (static_shapes.span_rung) its calls reach; each decoder has a code object of its own, so other models' and
# dead engines' graphs do not count against it.
_RECOMPILE_LIMIT = 256


# CUDA errors that are sticky: the context is unusable afterwards (every later call fails), so no
# fallback can keep the run going; CUDA's runtime API names them in the messages PyTorch raises.
_STICKY_CUDA_ERRORS = ("illegal memory access", "device-side assert", "misaligned address",
                       "unspecified launch failure", "illegal instruction", "invalid program counter",
                       "hardware stack error", "launch timed out", "uncorrectable ecc",
                       "cublas_status_execution_failed")


def poisons_device(error: BaseException) -> bool:
    """Whether ``error`` leaves the CUDA context unusable (an illegal address, a device-side
    assert, ...): such an error must end the run, not be swallowed by a fallback. A capture the
    driver refuses, an out-of-memory or a compile failure does not."""
    return any(name in str(error).lower() for name in _STICKY_CUDA_ERRORS)


class StaticState(KVSlots):
    """The engine-life state of the static step: the one KV state (llamarl/engines/kv_slots.py:
    per layer ``caches[l]`` ``[2, slots, kv, width, d]``, ``tokens`` / ``positions``; fixed, never
    grown: the graphs read its addresses) and what the graphs add: RoPE's ``cos`` / ``sin``
    ``[width, d]`` (the sine's first half negated: ``static_step.rotations``), the step's output
    ``logits`` ``[slots, vocab]`` (a bucket of r rows writes its first r rows), the in-graph
    sampler's per-slot ``records`` and the captured graphs by (bucket, span, sampling).

    ``logits`` is allocated here, before any capture, and each graph writes it with its last GEMM
    (``out=``): it is no memory of the graphs' pool, where another bucket's capture may place its
    scratch (a graph's own output, allocated inside its capture, would be such memory)."""

    def __init__(self, *, caches: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                 logits: torch.Tensor) -> None:
        super().__init__(caches=caches)
        self.cos, self.sin, self.logits = cos, sin, logits
        self.records = SlotRecords(slots=self.capacity, width=self.width, vocab=logits.shape[1],
                                   device=self.tokens.device)
        """The in-graph sampler's per-slot records (llamarl/engines/static_sampling.py)."""
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        """Captured graphs by ``(rows, span, sampling key)`` (``StaticDecoder.step``)."""
        self.pool = None
        """The memory pool of ``graphs`` (a ``graph_pool_handle``): made with the first capture,
        dropped with the graphs (``release``), never captured into once they are gone."""

    def release(self) -> None:
        """Drop the captured graphs and their pool, then the buffers: the memory goes back to the
        allocator. The state is unusable afterwards."""
        self.graphs.clear()
        self.pool = None
        super().release()
        self.logits, self.records = None, None

    def move(self, sources: list[int], targets: list[int], *, num_columns: int) -> None:
        """``KVSlots.move``, the slots' sampling records with them."""
        super().move(sources, targets, num_columns=num_columns)
        if sources:
            device = self.tokens.device
            self.records.move(torch.tensor(sources, dtype=torch.long, device=device),
                              torch.tensor(targets, dtype=torch.long, device=device))


class StaticDecoder:
    """Static-shape decode steps of one HF model (module docstring); a decoder of the slot protocol
    (llamarl/engines/decoder.py) that runs buckets, admits rows mid-decode and keeps caches."""

    bucketed = True
    admits_mid_decode = True
    keeps_caches = True
    samples_in_step = True
    prefills_into_state = True
    """A prefill writes straight into its state (llamarl/engines/packed_prefill.py)."""
    """``step(..., sampling=key)`` samples and keeps the books inside the step (static_sampling.py)."""

    @staticmethod
    def supports(model: torch.nn.Module, *, length: int) -> bool:
        """True for the architectures this step reproduces (Llama, Qwen2, Mistral, Qwen3, Gemma2; a
        sliding window, if any, at least ``length`` positions long; every layer full attention; RoPE whose
        frequencies do not depend on the sequence length), unsharded (tensor parallelism takes the
        HF modules)."""
        config = model.config
        window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
        if type(model).__name__ not in _SUPPORTED or (window is not None and window < length):
            return False
        return reproduces(model) and not any(isinstance(p, DTensor) for p in model.parameters())

    def __init__(self, model: torch.nn.Module, *, compiled: bool = False, backend: str = "inductor",
                 cuda_graphs: bool | None = None, kernels: str | None = None) -> None:
        """``compiled``: run ``static_forward`` through ``torch.compile(fullgraph=True,
        dynamic=None)`` with ``backend`` (``"eager"`` traces without generating code: tests);
        False (default) runs it eagerly. ``cuda_graphs`` (None: when the model is on CUDA): capture
        each bucket's step as a CUDA graph, compiled or not (module docstring). ``kernels``
        (``"torch"`` / ``"fused"``; None: ``step_kernels.choose_kernels``, fused on CUDA where
        Triton imports): the step's kernel set (llamarl/engines/step_kernels.py)."""
        self.model = model
        config = model.config
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # The attention's own (Gemma2: query_pre_attn_scalar ** -0.5; the others head_dim ** -0.5).
        self.scaling = getattr(model.model.layers[0].self_attn, "scaling", self.head_dim ** -0.5)
        self.compiled = compiled
        # A code object of its own: dynamo caches graphs per code object (module constant above).
        own = types.FunctionType(static_forward.__code__.replace(), static_forward.__globals__, "static_forward")
        # dynamic=None: the first bucket compiles with static shapes, the second recompiles with the
        # rows symbolic, and that graph serves every later bucket (two compiles, not one per bucket).
        self._forward = torch.compile(own, fullgraph=True, dynamic=None, backend=backend) if compiled else own
        device = model.get_input_embeddings().weight.device
        self.cuda_graphs = device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and device.type != "cuda":
            raise ValueError(f"cuda_graphs needs the model on CUDA, it is on {device}")
        if kernels is not None and kernels not in KERNEL_SETS:
            raise ValueError(f"unknown step kernels {kernels!r}; known: {', '.join(KERNEL_SETS)}")
        self.kernels = KERNEL_SETS[kernels] if kernels else choose_kernels(model, cuda=device.type == "cuda")
        """The step's kernel set (llamarl/engines/step_kernels.py)."""
        self.state: StaticState | None = None
        """The engine-life state (``reserve``); None before the first call and after ``release``."""
        self._weights: tuple[int, ...] = ()
        self._fused: list | None = None
        """Per layer the fused q / k / v and gate / up buffers (``fuse_projections``), made at the
        first ``reserve``: from then on the model's projections are slices of them."""
        self.num_steps = 0
        """Steps run (cumulative; a captured graph's replays included)."""
        self.num_captures = 0
        """CUDA graphs captured (cumulative: each bucket once per state, i.e. once for the engine's
        life unless a call needs a larger state or a parameter was rebound)."""
        self.capture_seconds = 0.0
        """Wall seconds spent capturing graphs (cumulative)."""
        self.num_calls = 0
        """Decode loops completed with this decoder (``decode_loop.decode``)."""
        self.candidates: dict[tuple, int] = {}
        """Top-p candidates by sampling setting, grown x8 at each overflow (static_sampling.py)."""

    def sampling_key(self, sampling: SamplingParams) -> tuple:
        """The key of ``sampling`` for ``step`` (``static_sampling.sampling_key``), with the
        candidates this decoder has grown to for it."""
        vocab = self.model.lm_head.out_features
        plain = sampling_key(sampling, vocab=vocab, candidates=0)
        return sampling_key(sampling, vocab=vocab, candidates=self.candidates.get(plain[:3], FIRST_CANDIDATES))

    def grow_candidates(self, key: tuple) -> None:
        """A row's top-p candidates held less than ``top_p`` (static_sampling.py): 8x as many from now on."""
        self.candidates[key[:3]] = key[3] * 8

    def _weight_addresses(self) -> tuple[int, ...]:
        # What the graphs read: every parameter's and buffer's storage (an in-place copy keeps it).
        return tuple(t.data_ptr() for t in (*self.model.parameters(), *self.model.buffers()))

    def reserve(self, *, capacity: int, positions: int) -> StaticState:
        """The engine-life state, with at least ``capacity`` slots and ``positions`` positions per
        row: the current one when it is large enough and its graphs still read the model's
        parameters, else a new one (at least as large as the old; the old one's graphs and memory
        released first). On CUDA its graphs are captured at the first step of each (bucket,
        span) pair (``step``), then replayed for the state's life."""
        # The graphs read q / k / v and gate / up through their fused buffers: parameters rebound
        # since (another storage) are put back into one (static_step.fuse_projections).
        self._fused = fuse_projections(self.model, self.kernels)
        weights = self._weight_addresses()
        state = self.state
        if state is not None:
            if state.capacity >= bucket(capacity) and state.width >= state_width(positions) and weights == self._weights:
                return state
            capacity, positions = max(capacity, state.capacity), max(positions, state.width)
            self.release()
        state = self.state = self.new_state(capacity=capacity, positions=positions)
        self._weights = weights
        return state

    def release(self) -> None:
        """Drop the engine-life state: its graphs, their pool, its KV cache (a colocated trainer's
        memory, or the engine's end)."""
        if self.state is not None:
            self.state.release()
            self.state = None

    def new_state(self, *, capacity: int, positions: int) -> StaticState:
        """A zeroed state with at least ``capacity`` slots (rounded up to a bucket) and room for
        ``positions`` positions per row (rounded up to a power of two >= 64), in the model's dtype
        and on its device; its ``logits`` in the LM head's."""
        weight = self.model.get_input_embeddings().weight
        slots, width = bucket(capacity), state_width(positions)
        shape = (slots, self.num_kv_heads, width, self.head_dim)
        num_layers = len(self.model.model.layers)
        cos, sin = rope_tables(self.model, width=width, head_dim=self.head_dim)
        return StaticState(caches=[weight.new_zeros((2, *shape)) for _ in range(num_layers)], cos=cos, sin=sin,
                           logits=self.model.lm_head.weight.new_empty((slots, self.model.lm_head.out_features)))

    def attention_span(self, state: StaticState, rows: int, *, steps: int) -> int:
        """The span (``span_rung``) that covers the next ``steps`` steps of the first ``rows`` slots:
        their largest position now plus ``steps`` columns. Reads that position on the host (one
        synchronisation): the decode loop asks at its looks only, never between two.

        With a kernel set whose attention reads each row's own live columns (``reads_live_columns``:
        the fused set's decode attention), the span is the state's width and nothing is read: a
        span would only multiply the graphs (one per bucket, not per (bucket, span) pair)."""
        if self.kernels.reads_live_columns:
            return state.width
        longest = int(state.positions[:rows].max()) + steps
        return span_rung(min(longest, state.width), state.width)

    @torch.no_grad()  # the GEMMs' out= buffers refuse autograd
    def _run(self, state: StaticState, rows: int, columns: int | None = None, key: tuple | None = None) -> torch.Tensor:
        # Older torch (< 2.7) names the limit cache_size_limit.
        name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
        patch = torch._dynamo.config.patch(**{name: _RECOMPILE_LIMIT}) if self.compiled else contextlib.nullcontext()
        with patch:
            if self._fused is None:  # a state from new_state (not reserve)
                self._fused = fuse_projections(self.model, self.kernels)
            logits = self._forward(self.model, self._fused, state.tokens[:rows], state.positions[:rows],
                                   [c[:, :rows, :, :columns] for c in state.caches], state.cos, state.sin,
                                   state.logits[:rows], self.num_heads, self.num_kv_heads, self.head_dim, self.scaling)
        if key is not None:  # the draw and the books, in the same graph (static_sampling.py)
            records = state.records
            uniforms = None if key[0] == 0 else records.uniforms[:rows].gather(
                1, state.positions[:rows].unsqueeze(1)).squeeze(1)
            tokens, lps, ok = self.kernels.sample(logits, uniforms, key)
            self.kernels.book(records, rows, tokens, lps, ok, state.tokens, state.positions)
        return logits

    @torch.no_grad()
    def step(self, state: StaticState, rows: int, *, span: int | None = None,
             sampling: tuple | None = None) -> torch.Tensor:
        """Run the first ``rows`` slots (a bucket) one step: each feeds ``state.tokens[slot]`` at
        ``state.positions[slot]``; return their next-token logits ``[rows, vocab]``: the first
        ``rows`` rows of ``state.logits``, which every step writes (read them before the next
        step), allocated outside the graphs' pool (``StaticState``).

        ``span`` (a value of ``span_rung(columns, state.width)``; None: the whole width): the attention
        reads columns ``0 .. span - 1`` only, so its work is ``rows x span``, not ``rows x width``;
        every row's position must be < ``span`` (``attention_span``; not checked: a host read).
        ``sampling`` (a ``sampling_key``; None: logits only): the step also draws every row's next
        token and keeps its books in ``state.records`` (static_sampling.py), advancing the live
        rows' fed tokens and positions: nothing is left for the host to do between two looks.
        Each ``(rows, span, sampling)`` is one graph on CUDA, captured at its first step."""
        if rows != bucket(rows) or rows > state.capacity:
            raise ValueError(f"a step runs a bucket of at most {state.capacity} rows, got {rows}")
        columns = state.width if span is None else span
        if not 0 < columns <= state.width or span is not None and span_rung(columns, state.width) != columns:
            raise ValueError(f"a step's span is a rung of static_shapes.span_rung up to {state.width}, got {span}")
        self.num_steps += 1
        if not self.cuda_graphs:
            return self._run(state, rows, columns, sampling)
        captured = state.graphs.get((rows, columns, sampling))
        if captured is None:  # captured at the first step of its (bucket, span, sampling)
            captured = self._capture(state, rows, columns, sampling)
        graph, logits = captured
        graph.replay()
        return logits

    @torch.no_grad()
    def _capture(self, state: StaticState, rows: int, columns: int,
                 key: tuple | None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        start = time.perf_counter()
        # The books' step advances rows: the warm-up runs and the (fake) capture must leave them as they were.
        saved = state.records.snapshot(state.tokens, state.positions) if key is not None else []
        device = state.tokens.device
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):  # compiled: compile, then a run with the allocator warm; idempotent (module docstring)
                self._run(state, rows, columns, key)
        torch.cuda.current_stream(device).wait_stream(side)
        restore(saved)
        if state.pool is None:  # the state's graphs share one pool, which dies with them (module docstring)
            state.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        current = torch.cuda.current_stream(device)
        try:
            # thread_local: a CUDA call of another thread (a tool worker, a data loader) does not void it.
            with torch.cuda.graph(graph, pool=state.pool, capture_error_mode="thread_local"):
                logits = self._run(state, rows, columns, key)
        except BaseException:
            # torch.cuda.graph ends the capture before restoring the stream: a capture the driver
            # voided would leave its capture stream current for whatever runs next (the fallback).
            torch.cuda.set_stream(current)
            raise
        restore(saved)
        state.graphs[rows, columns, key] = (graph, logits)
        self.num_captures += 1
        self.capture_seconds += time.perf_counter() - start
        return graph, logits
