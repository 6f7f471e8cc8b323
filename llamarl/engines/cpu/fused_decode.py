"""A faster decode step for Llama-family models: fused projections over a preallocated KV cache.

``TorchEngine`` prefills with the HF model as before; the decode steps then run here when the
model qualifies (``FusedDecoder.supports``: HF ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` /
``Qwen3ForCausalLM`` (its q / k norms applied per head before RoPE) / ``MistralForCausalLM`` whose
sliding window, if any, is longer than the sequences; plain CPU
tensors, no tensor parallelism; ``--generator.no-fused-decode`` / ``TorchEngine(fused_decode=False)``
turns it off):

* **fused projections**: q, k and v as one matmul, gate and up as one, so a layer runs four
  matmuls instead of seven; on CPU the weights are also packed for a faster matmul, each layout
  made on its first use: for ``cpu_kernels.linear`` in bf16 where the CPU has AVX512-BF16, else
  pre-packed for oneDNN (``torch.ops.mkldnn._reorder_linear_weight``), which reads them far faster
  at a few rows, except a single bf16 row without the GEMM, which takes ``F.linear`` (oneDNN's
  pre-packed bf16 path was seen taking seconds there on real weights: ``_Linear``; the timings:
  docs/architecture.md, "The CPU kernels' limits"). The fused and packed copies are derived from the live weights: every call compares
  the weights' version counters (bumped by any in-place write, the weight channels' included) with
  those they were built from and rebuilds them when a weight changed, so an in-place update takes
  effect at the next call as it does with the HF modules (a parameter replaced by a new tensor is
  seen at the next ``generate``: ``refresh``). Memory: the fused q/k/v and gate/up weights are
  copies, and each packed layout in use is one more copy of the projections' weights (the LM head
  included);
* **a preallocated KV cache**: the native engine's one KV state (llamarl/engines/kv_slots.py, the
  CUDA-graph step's too), one row per slot, each row's positions left-aligned, so rows of different
  lengths share a step: each token's keys and values are written in place at its own row's column,
  and what each row sees follows from its position (no per-step concatenation). A
  finished row leaves by an order-keeping compaction, and a new row (a pending request, prefilled;
  or a carried sample whose cache was kept) can join the batch at any step (continuous batching,
  ``TorchEngine(max_num_seqs=)``); the attention of the single query row is two small matmuls and
  a softmax, as HF's eager attention computes it (SDPA's CPU kernel spends ~1 ms per layer on a
  single row).

* **C kernels in bf16** (``cpu_kernels``; on PyTorch's intra-op threads where built with OpenMP,
  else on one thread, and then with more intra-op threads only up to ``cpu_kernels.THREADED_ROWS``
  rows): each layer is eight kernels (the four projections; attention with RoPE and the cache
  write over each row's own columns; the residual adds fused with the next RMSNorm; SwiGLU), the
  projections through an AMX or AVX512-BF16 GEMM where the CPU has it (``gemm_max_rows``); where
  every projection takes the GEMM, all the layers of a step are one C call (``native_step``; the
  step's time: docs/benchmarks.md, "The native engine on CPU"). They round where HF's bf16
  modules round, so their outputs are HF's up to the order of fp32 sums.

* **Elsewhere** (fp32 models, rows the C kernels do not take, ``LLAMARL_CPU_KERNELS=0``): the
  step the CUDA graphs capture (llamarl/engines/static_step.py ``static_forward``, run eagerly over
  the same state), so the Llama-family step is written once in Python for both devices and the C
  kernels are the CPU's backend of it. Its numerics are HF's to fp32 rounding (bf16: to a bf16
  rounding per op): greedy tokens equal the HF loop's (tests) and log-probs agree to rounding.

A finished row is dropped from the batch exactly as in the HF loop (same live rows at every step,
so a seeded sampler draws the same numbers).
"""

from __future__ import annotations

import operator

import torch
from torch.distributed.tensor import DTensor

from llamarl.engines.cpu import cpu_kernels, native_step
from llamarl.engines.kv_slots import KVSlots
from llamarl.engines.static_step import fuse_projections, reproduces, rope_tables, static_forward

_SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
_RMS_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")


def _mkldnn_ready(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and torch.backends.mkldnn.is_available()
            and weight.dtype in (torch.float32, torch.bfloat16))


def _gemm_takes(rows: int) -> bool:
    """Whether a projection with the C GEMM (``_Linear.gemm``) runs it at ``rows`` rows on this
    many intra-op threads (``cpu_kernels.gemm_max_rows``), rather than oneDNN."""
    most = cpu_kernels.gemm_max_rows(torch.get_num_threads())
    return most is None or rows <= most


class _Linear:
    """One fused projection: its weight (and bias); in bf16 on a CPU with AVX512-BF16, packed for
    ``cpu_kernels.linear`` (faster than oneDNN at 1 to 64 rows; up to ``cpu_kernels.gemm_max_rows``),
    otherwise pre-packed for oneDNN on its
    first call (which reads the weights far faster than the plain layout at a few rows)."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> None:
        self.weight = torch.cat(weights) if len(weights) > 1 else weights[0]
        self.bias = None if biases[0] is None else (torch.cat(biases) if len(biases) > 1 else biases[0])
        self.gemm = (self.weight.dtype == torch.bfloat16 and self.weight.device.type == "cpu"
                     and self.weight.is_contiguous() and cpu_kernels.gemm_available()
                     and (self.bias is None or (self.bias.dtype == torch.bfloat16 and self.bias.device.type == "cpu"
                                                and self.bias.is_contiguous())))
        # Each layout is made on its first use (0.16-0.18 s for SmolLM2's weights, again after every
        # weight update): a run whose steps all take one path builds only that one.
        self.kernel: cpu_kernels.PackedWeight | None = None
        self._onednn: torch.Tensor | None = None

    def packed(self) -> cpu_kernels.PackedWeight:
        """The weight in ``cpu_kernels.linear``'s layout (packed on the first call; needs ``gemm``)."""
        if self.kernel is None:
            self.kernel = cpu_kernels.pack(self.weight)
        return self.kernel

    def __call__(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T + bias``; ``out`` (a reused buffer) is written only on the C GEMM's path."""
        rows = x.shape[0]
        if self.gemm and _gemm_takes(rows):
            return cpu_kernels.linear(x, self.packed(), self.bias, out=out)
        # Not at one bf16 row: there oneDNN's pre-packed matmul took 61 ms for one 3072 x 576 projection
        # of SmolLM2's own weights (torch 2.13, Zen 4; 0.1 ms with random weights of that shape, 0.3 ms
        # through F.linear), so a row alone takes PyTorch's plain matmul.
        if _mkldnn_ready(self.weight) and (rows > 1 or self.weight.dtype != torch.bfloat16):
            if self._onednn is None:  # the rows of the first call tune the layout (oneDNN's hint)
                self._onednn = torch.ops.mkldnn._reorder_linear_weight(self.weight, rows)
            return torch.ops.mkldnn._linear_pointwise(x, self._onednn, self.bias, "none", [], "")
        return torch.nn.functional.linear(x, self.weight, self.bias)


class FusedDecoder:
    """Decode steps of one HF Llama-family model (module docstring); a decoder of the slot
    protocol (llamarl/engines/decoder.py) over the one KV state (llamarl/engines/kv_slots.py): not
    bucketed (a step runs exactly the live rows, which the loop keeps at the front after every step,
    where a host read costs nothing), admits rows mid-decode (continuous batching) and keeps
    carried caches."""

    bucketed = False
    admits_mid_decode = True
    keeps_caches = True
    prefills_into_state = True
    """A prefill writes straight into its state (llamarl/engines/packed_prefill.py)."""

    @staticmethod
    def supports(model: torch.nn.Module, *, length: int) -> bool:
        """True for the architectures and layouts this step reproduces exactly (module docstring),
        for a decode whose sequences reach ``length`` positions (a sliding window shorter than that
        would change the attention: the HF modules handle it)."""
        config = model.config
        window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
        if type(model).__name__ not in _SUPPORTED or (window is not None and window < length):
            return False
        if any(isinstance(p, DTensor) or p.device.type != "cpu" for p in model.parameters()):
            # Tensor parallel (or otherwise sharded): the HF modules handle it. Not on accelerators
            # yet: the fused copies would double the weights' memory there, and a GPU decode step
            # is host-bound (it needs a captured graph, not fewer matmuls).
            return False
        # q / k norms (Qwen3): RMSNorms over each head, which the step applies before RoPE, a layer's
        # two with one epsilon (the C attention takes one).
        if not reproduces(model):  # the shared step's conditions (static_step.static_forward)
            return False
        pairs = _qk_norms(model)
        if pairs is None:
            return all(getattr(layer.self_attn, name, None) is None for layer in model.model.layers
                       for name in ("q_norm", "k_norm"))
        return all(type(q).__name__ in _RMS_NORMS and type(k).__name__ in _RMS_NORMS
                   and q.variance_epsilon == k.variance_epsilon for q, k in pairs)

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        config = model.config
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim ** -0.5
        self.num_calls = 0
        """Decode loops completed with this decoder (``decode_loop.decode``)."""
        self._fused: list[tuple[_Linear, _Linear, _Linear, _Linear]] | None = None
        self._head: _Linear | None = None
        self._built_from: tuple[tuple[int, int], ...] = ()
        self._source_tensors: list[torch.Tensor] | None = None
        self._workspace: dict[str, torch.Tensor] = {}
        self._shared: list | None = None
        """The shared step's fused q / k / v and gate / up buffers (``static_step.fuse_projections``)."""
        self._rope_tables: tuple[torch.Tensor, torch.Tensor] | None = None
        self._packed_for: list | None = None  # the build whose projections _pack_together packed
        layers = model.model.layers
        norms = [m for layer in layers for m in (layer.input_layernorm, layer.post_attention_layernorm)]
        norms += [m for pair in _qk_norms(model) or [] for m in pair]
        # The C layer helpers (cpu_kernels): bf16 on the CPU, these families' RMSNorm and SwiGLU.
        self._native = (model.model.embed_tokens.weight.dtype == torch.bfloat16
                        and model.model.embed_tokens.weight.device.type == "cpu"
                        and getattr(config, "hidden_act", None) == "silu"
                        and all(type(m).__name__ in _RMS_NORMS for m in (*norms, model.model.norm))
                        and cpu_kernels.available())
        eps = {m.variance_epsilon for m in (*norms, model.model.norm)} if self._native else set()
        # The whole step in one C call (native_step) where the projections take the C GEMM: one
        # epsilon for every norm (the C step takes one), attention's limits. False: kernel by kernel.
        self.one_call = (len(eps) == 1 and self.head_dim <= 512 and self.head_dim % 2 == 0
                         and self.num_heads % self.num_kv_heads == 0)
        self._eps = eps.pop() if len(eps) == 1 else None

    def refresh(self) -> None:
        """Look up the model's parameters again at the next step (``TorchEngine`` calls this at
        every ``generate``): a parameter *replaced* by another tensor is then seen, as an in-place
        write always is (its version counter)."""
        self._source_tensors = None
        self._shared = None  # the shared step's fused buffers: re-checked (static_step.fuse_projections)

    def _sources(self) -> list[torch.Tensor]:
        # Walking the modules costs ~1.5 ms (SmolLM2): once per generate call, not once per step.
        if self._source_tensors is None:
            self._source_tensors = [p for layer in self.model.model.layers
                                    for p in (*layer.self_attn.parameters(), *layer.mlp.parameters())]
            self._source_tensors.append(self.model.lm_head.weight)
        return self._source_tensors

    def _layers(self) -> list[tuple[_Linear, _Linear, _Linear, _Linear]]:
        versions = tuple((id(p), p._version) for p in self._sources())
        if self._fused is None or versions != self._built_from:
            self._built_from = versions
            self._packed_for = None  # the previous build's packed weights: not held past it
            fused = []
            for layer in self.model.model.layers:
                attn, mlp = layer.self_attn, layer.mlp
                fused.append((
                    _Linear([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight],
                            [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]),
                    _Linear([attn.o_proj.weight], [attn.o_proj.bias]),
                    _Linear([mlp.gate_proj.weight, mlp.up_proj.weight], [mlp.gate_proj.bias, mlp.up_proj.bias]),
                    _Linear([mlp.down_proj.weight], [mlp.down_proj.bias])))
            self._fused = fused
            head = self.model.lm_head  # the LM head too: a fifth of SmolLM2's weights, read every step
            self._head = _Linear([head.weight], [head.bias])
        return self._fused

    def new_state(self, *, capacity: int, like: torch.Tensor | None = None, positions: int = 0) -> KVSlots:
        """An empty decode state (the one KV state, llamarl/engines/kv_slots.py, growable) with room
        for ``capacity`` rows, in ``like``'s dtype and on its device (None: the model's embedding's);
        its width grows with the rows' lengths (``KVSlots.grow``). ``positions``: the
        most positions a row of this decode can reach (prompt + new tokens), reserved at once where
        a step's cost does not depend on the cache's width (``width_free``), so the decode never
        widens the cache mid-way (a widening copies every layer's cache: at 64 rows of SmolLM2 going
        from 64 to 128 columns, ~150 ms, 4.7 ms of each of 32 steps on one thread). Elsewhere the
        PyTorch step attends over every allocated column, so the width grows only as rows need it.
        Reserving is what the decode reaches anyway once one row runs to its limit (the width is
        the batch's longest row), but rows that stop at EOS never need it: the reservation stops at
        ``_RESERVED_CACHE`` bytes (GSM8K's 16 rows x ~300 positions of SmolLM2 are 110 MB), past
        which the cache grows as before."""
        like = self.model.get_input_embeddings().weight if like is None else like
        num_layers = len(self.model.model.layers)
        state = KVSlots.zeros(layers=num_layers, slots=capacity, kv_heads=self.num_kv_heads, width=0,
                              head_dim=self.head_dim, like=like, growable=True)
        if positions > 0 and self.width_free(capacity):
            per_column = 2 * num_layers * capacity * self.num_kv_heads * self.head_dim * like.element_size()
            state.grow(min(positions, max(_RESERVED_CACHE // per_column, 1)))
        return state

    def reserve(self, *, capacity: int, positions: int) -> KVSlots:
        """The slot protocol's state for one decode loop (llamarl/engines/decoder.py): the weights
        looked up again (``refresh``), then ``new_state``. A state lives for one call."""
        self.refresh()
        return self.new_state(capacity=capacity, positions=positions)

    def width_free(self, rows: int) -> bool:
        """True when a step over up to ``rows`` rows costs the same at any cache width: it runs the
        C attention (``cpu_kernels``), which reads each row's own positions only."""
        most = cpu_kernels.helpers_max_rows(torch.get_num_threads()) if self._native else None
        return self._native and (most is None or rows <= most)

    @torch.no_grad()
    def step(self, state: KVSlots, rows: int, *, fresh_logits: bool = False) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of the next token after ``state.tokens[:rows]``, each fed at its
        slot's position ``state.positions[:rows]``, where its keys and values are written (the
        state widened first if a position needs it; the decode loop advances the positions).
        Through the C kernels (bf16 on CPU) the logits may be a buffer the next step overwrites
        (``_LOGITS_KEPT``): read them before stepping again, or pass ``fresh_logits`` for a step
        whose logits must outlive another's (a step of kept caches taken
        while the batch's own logits wait to be sampled) or must not overwrite them."""
        tokens, columns = state.tokens[:rows], state.positions[:rows]  # a position is its column
        state.grow(int(columns.max()) + 1)  # a CPU tensor: no device synchronisation
        if self.width_free(rows):
            return self._step_native(state, tokens, columns, fresh_logits=fresh_logits)
        # Elsewhere (fp32, or rows the C kernels do not take): the CUDA graphs' own step
        # (static_step.static_forward), run eagerly over the same state: one Llama-family step in
        # Python for both devices, the C kernels above the CPU's backend where they apply. It
        # attends over every allocated column (masked past a row's position): the cache's rows are
        # then contiguous batches (a column slice was ~4x slower on CPU: 16 rows x 3 KV heads, 300 of
        # 420 columns, bf16: 557 us sliced, 159 us whole).
        cos, sin = self._rope(state)
        if self._shared is None:
            self._shared = fuse_projections(self.model)  # per generate call (refresh drops it)
        logits = self.model.lm_head.weight.new_empty((rows, self.model.lm_head.out_features))
        return static_forward(self.model, self._shared, tokens, columns, [c[:, :rows] for c in state.caches], cos, sin,
                              logits, self.num_heads, self.num_kv_heads, self.head_dim, self.scaling)

    def _rope(self, state: KVSlots) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's tables for the state's width (``static_step.rope_tables``), kept on the decoder
        until the state widens past them."""
        if self._rope_tables is None or self._rope_tables[0].shape[0] < state.width:
            self._rope_tables = rope_tables(self.model, width=state.width, head_dim=self.head_dim)
        cos, sin = self._rope_tables
        return cos[: state.width], sin[: state.width]

    def _buffers(self, rows: int, layer: tuple[_Linear, _Linear, _Linear, _Linear], *,
                 like: torch.Tensor) -> dict[str, torch.Tensor]:
        """The native step's intermediate outputs, reused from step to step and layer to layer
        (each is read before the next layer writes it): fresh tensors cost their first touch's page
        faults, ~4 ms of a 64-row SmolLM2 step (32 MB of intermediates) on one thread."""
        qkv, _, gate_up, _ = layer
        hidden = like.shape[-1]
        widths = {"qkv": qkv.weight.shape[0], "attended": self.num_heads * self.head_dim, "delta": hidden,
                  "x": hidden, "gate_up": gate_up.weight.shape[0], "act": gate_up.weight.shape[0] // 2}
        # Rows up to a multiple of 16: the one-call step's AMX GEMMs read them in place.
        padded = _buffers_for(self._workspace, rows=native_step.padded_rows(rows), widths=widths, like=like)
        return {name: buffer[:rows] for name, buffer in padded.items()}

    def _pack_together(self, fused: list[tuple[_Linear, _Linear, _Linear, _Linear]], rows: int) -> None:
        """Pack every projection of this build that takes the C GEMM at ``rows`` rows, and the LM
        head, into one allocation on huge pages (``cpu_kernels.pack_all``: the step streams them
        one after another), once per build; the projections left out (oneDNN's rows) pack alone,
        on their first C call, if they ever get one."""
        if self._packed_for is fused:
            return
        if not _gemm_takes(rows):
            return
        linears = [linear for layer in fused for linear in layer] + [self._head]
        linears = [linear for linear in linears if linear.gemm and linear.kernel is None]
        for linear, packed in zip(linears, cpu_kernels.pack_all([linear.weight for linear in linears]), strict=True):
            linear.kernel = packed
        self._packed_for = fused

    def _in_one_call(self, fused: list[tuple[_Linear, _Linear, _Linear, _Linear]], rows: int) -> bool:
        """True when this step's layers run as one C call (``native_step``): ``one_call``, and every
        projection takes the C GEMM at ``rows`` rows."""
        if not (self.one_call and native_step.available()):
            return False
        return _gemm_takes(rows) and all(linear.gemm for layer in fused for linear in layer)

    def _layer_tables(self, fused: list[tuple[_Linear, _Linear, _Linear, _Linear]],
                      state: KVSlots) -> native_step.LayerTables:
        """``native_step``'s checked address table of the layers' tensors, kept on ``state`` (so it
        holds nothing past the state's own caches and projections) and rebuilt when any of them is
        another object or at another address (new projections after a weight update, widened
        caches, a norm or bias replaced or given new storage)."""
        layers = self.model.model.layers
        norms = [(layer.input_layernorm.weight, layer.post_attention_layernorm.weight) for layer in layers]
        pairs = _qk_norms(self.model)
        qk_norms = None if pairs is None else [(q.weight, k.weight) for q, k in pairs]
        addresses = [tensor.data_ptr() for pair in norms + (qk_norms or []) for tensor in pair] + [
            linear.bias.data_ptr() for layer in fused for linear in layer if linear.bias is not None]
        caches = state.keys + state.values
        if state.native_tables is not None:
            (built_for, built_at, built_from), tables = state.native_tables
            if built_for is fused and built_at == addresses and len(built_from) == len(caches) \
                    and all(map(operator.is_, built_from, caches)):
                return tables
        projections = [[(linear.packed(), linear.bias) for linear in layer] for layer in fused]
        config = self.model.config
        shape = native_step.Shape(dim=config.hidden_size, heads=self.num_heads, kv_heads=self.num_kv_heads,
                                  head_dim=self.head_dim, inter=fused[0][2].weight.shape[0] // 2)
        tables = native_step.LayerTables(shape=shape, projections=projections, norms=norms, keys=state.keys,
                                         values=state.values, qk_norms=qk_norms)
        state.native_tables = ((fused, addresses, caches), tables)
        return tables

    @torch.no_grad()
    def _step_native(self, state: KVSlots, tokens: torch.Tensor, positions: torch.Tensor, *,
                     fresh_logits: bool = False) -> torch.Tensor:
        """``step`` through the C layer helpers (``cpu_kernels``): per layer the q/k/v projection,
        attention (RoPE, the cache write, grouped-query attention over each row's own columns), the
        output projection, the residual add with the next norm, gate/up, SwiGLU, down and again the
        residual add with the next norm: eight kernels instead of ~35 ops; all the layers in one C
        call where every projection takes the C GEMM (``native_step``), else kernel by kernel."""
        model = self.model
        rows = tokens.shape[0]
        hidden = model.model.embed_tokens(tokens)  # [rows, hidden], a new tensor: updated in place below
        cos, sin = model.model.rotary_emb(hidden.unsqueeze(1), positions.unsqueeze(1))
        cos, sin = cos.reshape(rows, -1).contiguous(), sin.reshape(rows, -1).contiguous()
        layers = model.model.layers
        fused = self._layers()
        self._pack_together(fused, rows)
        work = self._buffers(rows, fused[0], like=hidden)
        if self._in_one_call(fused, rows):
            tables = self._layer_tables(fused, state)
            floats = cpu_kernels._threads() * cpu_kernels.attention_scratch(
                num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, width=tables.width)
            scratch = self._workspace.get("scratch")
            if scratch is None or scratch.numel() < floats:
                scratch = self._workspace["scratch"] = torch.empty(floats, dtype=torch.float32, device=hidden.device)
            native_step.decode_layers(tables, hidden=hidden, buffers={name: self._workspace[name] for name in work},
                                      cos=cos, sin=sin, positions=positions, final_norm=model.model.norm.weight,
                                      eps=self._eps, scaling=self.scaling, scratch=scratch)
            return self._logits(work["x"], rows=rows, fresh_logits=fresh_logits)
        first, qk_norms = layers[0].input_layernorm, _qk_norms(model)
        x = cpu_kernels.rmsnorm(hidden, first.weight, eps=first.variance_epsilon)
        for index, (layer, (qkv, out, gate_up, down)) in enumerate(zip(layers, fused)):
            q_norm, k_norm = qk_norms[index] if qk_norms is not None else (None, None)
            attended = cpu_kernels.attention(qkv(x, out=work["qkv"]), cos=cos, sin=sin, keys=state.keys[index],
                                             values=state.values[index], positions=positions,
                                             num_heads=self.num_heads, scaling=self.scaling, out=work["attended"],
                                             q_norm=None if q_norm is None else q_norm.weight,
                                             k_norm=None if k_norm is None else k_norm.weight,
                                             norm_eps=0.0 if q_norm is None else q_norm.variance_epsilon)
            norm = layer.post_attention_layernorm
            x = cpu_kernels.add_rmsnorm(hidden, out(attended, out=work["delta"]), norm.weight,
                                        eps=norm.variance_epsilon, out=work["x"])
            mlp = down(cpu_kernels.silu_mul(gate_up(x, out=work["gate_up"]), out=work["act"]), out=work["delta"])
            norm = layers[index + 1].input_layernorm if index + 1 < len(layers) else model.model.norm
            x = cpu_kernels.add_rmsnorm(hidden, mlp, norm.weight, eps=norm.variance_epsilon, out=work["x"])
        return self._logits(x, rows=rows, fresh_logits=fresh_logits)

    def _logits(self, x: torch.Tensor, *, rows: int, fresh_logits: bool) -> torch.Tensor:
        """The native step's end: the LM head on ``x`` (the final norm)."""
        vocab = self._head.weight.shape[0]
        if fresh_logits or rows * vocab > _LOGITS_KEPT:
            return self._head(x)
        return self._head(x, out=_buffers_for(self._workspace, rows=rows, widths={"logits": vocab}, like=x)["logits"])


_RESERVED_CACHE = 512 * 2**20
"""Bytes of KV cache (keys and values of every layer) ``FusedDecoder.new_state`` reserves at once at
most: up to it a decode never widens its cache mid-way; a decode that may reach more (64 rows of
4,096 new tokens of SmolLM2 would be 6 GB, zero-filled at every ``generate``) grows it from there,
as rows need it."""

_LOGITS_KEPT = 32 * 2**20
"""Logits (bf16) up to which the native step writes them into a buffer kept for the next step (64
MiB: 64 rows of SmolLM2's 49k vocabulary are 6.3 MB, whose first touch in a fresh tensor cost ~1 ms
of page faults a step); more rows of a larger vocabulary get a new tensor each step."""


def _buffers_for(workspace: dict[str, torch.Tensor], *, rows: int, widths: dict[str, int],
                 like: torch.Tensor) -> dict[str, torch.Tensor]:
    """The first ``rows`` rows of ``workspace``'s buffers (grown, for more rows or another model's
    widths, by replacing them): one bf16 ``[rows, width]`` per name of ``widths``."""
    for name, width in widths.items():
        buffer = workspace.get(name)
        if buffer is None or buffer.shape[0] < rows or buffer.shape[1] != width or buffer.device != like.device:
            workspace[name] = torch.empty((rows, width), dtype=torch.bfloat16, device=like.device)
    return {name: workspace[name][:rows] for name in widths}


def _qk_norms(model: torch.nn.Module) -> list[tuple[torch.nn.Module, torch.nn.Module]] | None:
    """Per layer the (q_norm, k_norm) modules of a model that normalizes each query and key head
    before RoPE (Qwen3), looked up afresh (a replaced module is seen); None when its first layer has
    none (``supports`` checks that no layer has them then)."""
    layers = model.model.layers
    if getattr(layers[0].self_attn, "q_norm", None) is None:
        return None
    return [(getattr(layer.self_attn, "q_norm", None), getattr(layer.self_attn, "k_norm", None)) for layer in layers]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
