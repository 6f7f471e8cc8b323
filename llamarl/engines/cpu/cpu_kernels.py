"""C kernels for bf16 CPU decode steps: the linear layers (an AVX512-BF16 GEMM over weights packed
for it), and the norms, attention and activation of a layer as one call each (``csrc/bf16_decode.c``);
the sampler's softmax and draw (``csrc/softmax.c``); a step's layers in one call (``native_step``).

Why: a decode step reads every weight once and, at a few rows, does little arithmetic per byte, so
its floor is the weights' bytes over the memory bandwidth (at one row) or the matmuls' FLOPs over
the core's (from ~16 rows); what keeps eager PyTorch from it on a CPU is (1) oneDNN's bf16 matmul
at small row counts, and (2) ~35 small ops per layer at a few microseconds each. The GEMM reads
weights packed once (``pack``: panels of 16 output rows, each input-column pair's 16 x 2 weights
side by side), so one 64-byte load is a VDPBF16PS operand for 16 outputs, a pair of x's columns is
one broadcast, and 6 rows x 64 outputs of fp32 sums stay in registers (no horizontal sums); up
to 4 rows it takes one panel at a time, so the weights stream in one sequence, and ``pack_all``
puts a decode step's weights in one allocation on huge pages (``FusedDecoder`` packs with it).
On one thread of a CPU without AMX the GEMM is faster than oneDNN's matmul at every row count it
was timed at; with more threads and a library built without OpenMP, oneDNN splits the work and wins
from a few rows, so the GEMM runs there for at most ``GEMM_THREADED_ROWS`` rows (the timings behind
these limits: docs/architecture.md, "The CPU kernels' limits"). The layer helpers replace the ops
around the linears: RMSNorm (with the residual add before it), RoPE + the KV-cache write +
grouped-query attention over each row's valid columns only, and SwiGLU's ``silu(gate) * up``.

What they compute: each rounds to bf16 where HF's eager bf16 modules round and computes in fp32 in
between, so the outputs equal theirs up to the order of fp32 sums (the last bf16 bit, now and then;
``tests/test_cpu_kernels.py`` checks each against the PyTorch ops it replaces). fp32 models never
use them (the PyTorch path reproduces HF's tokens exactly there).

Threads: built with OpenMP (``-fopenmp``; ``threaded()``), each kernel splits its work across
PyTorch's intra-op threads (``torch.get_num_threads()``, read per call): the GEMMs by panels of
outputs (each thread reads its own share of the weights, so two cores read them at twice one's
bandwidth), attention by (row, KV head), the norms, SwiGLU and the softmax by rows. The split never
changes a sum's order: outputs are bitwise the same on any thread count (tested). The library links
``libgomp.so.1``, which PyTorch (CPU wheels, ATen's OpenMP backend) has loaded already, so the
kernels and PyTorch's ops share one pool of threads. A compiler without OpenMP gives a library that
runs on the calling thread; with more than one intra-op thread the layer helpers then run only up
to ``THREADED_ROWS`` rows and the GEMM up to ``GEMM_THREADED_ROWS`` (PyTorch's ops split the work
above them).

When: bf16 weights on the CPU; a C compiler (``$CC``, else ``cc`` / ``gcc``); not
``LLAMARL_CPU_KERNELS=0``. The GEMM additionally needs the CPU's ``avx512_bf16`` flag (Linux x86-64;
the library is built with it where the CPU has it, without it elsewhere). The source is compiled
once per machine into ``$LLAMARL_CACHE_DIR`` (default ``$XDG_CACHE_HOME/llamarl`` or
``~/.cache/llamarl``), named by a hash of the source, the flags and the compiler, written to a
temporary file and renamed into place (ranks starting together may both compile; one file wins).
A failed compile is logged once and the callers keep the PyTorch ops: the kernels are an
accelerator, never a requirement. Loaded with ``ctypes`` (no Python headers; calls release the GIL).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from llamarl.engines.base import NonFiniteLogits

log = logging.getLogger("llamarl.engines.cpu.cpu_kernels")

GEMM_THREADED_ROWS = 2
"""With more than one intra-op thread and a library built without OpenMP (``threaded()`` False),
rows up to which ``linear`` (then single-threaded) still runs: above them oneDNN's matmul splits the
work across the threads (module docstring). Built with OpenMP, ``linear`` splits it too and runs at
any row count."""

GEMM_AMX_ROWS = 4
"""On one thread of a CPU with AMX whose library was built without the AMX GEMM (a compiler without
``-mamx-bf16``, or the kernel refused the tile state), rows up to which ``linear``'s AVX512-BF16
GEMM still runs: above them oneDNN's AMX matmul is faster (docs/architecture.md, "The CPU
kernels' limits"). With the AMX GEMM (``csrc/amx_gemm.c``) ``linear`` runs at any row count there."""

THREADED_ROWS = 16
"""With more than one intra-op thread and a library built without OpenMP, rows up to which
``FusedDecoder`` still runs its layers through the (then single-threaded) helpers: above them
PyTorch's ops, which use every thread, are faster (docs/architecture.md, "The CPU kernels'
limits"). On one thread, or built with OpenMP (``threaded()``: the kernels split their work across
the threads), they run at any row count."""

_SOURCE = Path(__file__).with_name("csrc") / "bf16_decode.c"
_SOURCES = (_SOURCE, _SOURCE.with_name("amx_gemm.c"), _SOURCE.with_name("softmax.c"),
            _SOURCE.with_name("decode_step.c"))
_HEADERS = (_SOURCE.with_name("bf16_math.h"), _SOURCE.with_name("kernels.h"))
_FLAGS = ["-O3", "-shared", "-fPIC", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]
_AVX512_BF16_FLAGS = ["-DLLAMARL_AVX512_BF16", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"]
_AMX_FLAGS = ["-DLLAMARL_AMX", "-mamx-tile", "-mamx-bf16"]
_OPENMP_FLAGS = ["-fopenmp"]
_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "llamarl_pack_bf16": ([_P] * 2 + [_I64] * 2, None),
    "llamarl_advise_huge": ([_P, _I64], _INT),
    "llamarl_gemm_bf16": ([_P] * 4 + [_I64] * 3 + [_INT], _INT),
    "llamarl_has_gemm": ([], _INT),
    "llamarl_gemm_amx_bf16": ([_P] * 4 + [_I64] * 3 + [_INT], _INT),
    "llamarl_has_amx": ([], _INT),
    "llamarl_amx_init": ([], _INT),
    "llamarl_has_openmp": ([], _INT),
    "llamarl_parallel_width": ([_INT], _INT),
    "llamarl_softmax_bf16": ([_P] * 2 + [_I64] * 2 + [_INT], None),
    "llamarl_sample_bf16": ([_P] * 4 + [_I64] * 2 + [_INT], _INT),
    "llamarl_rmsnorm_bf16": ([_P] * 3 + [_I64] * 2 + [_F32, _INT], None),
    "llamarl_add_rmsnorm_bf16": ([_P] * 4 + [_I64] * 2 + [_F32, _INT], None),
    "llamarl_silu_mul_bf16": ([_P] * 2 + [_I64] * 2 + [_INT], None),
    "llamarl_attention_bf16": ([_P] * 8 + [_I64] * 5 + [_F32, _P, _P, _F32, _INT], _INT),
    "llamarl_decode_layers_bf16": ([_P], _INT),
}


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """This Linux x86-64 CPU's feature flags (``/proc/cpuinfo``); empty elsewhere."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return frozenset()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        return frozenset()
    return frozenset()


def cpu_has_avx512_bf16() -> bool:
    """True when this Linux x86-64 CPU reports the ``avx512_bf16`` flag (``/proc/cpuinfo``)."""
    return "avx512_bf16" in cpu_flags()


def gemm_max_rows(num_threads: int) -> int | None:
    """The most rows ``linear`` should run on ``num_threads`` intra-op threads (None: any), where
    oneDNN's matmul is not faster. More than one thread with a library built without OpenMP:
    ``GEMM_THREADED_ROWS`` (``linear`` is then single-threaded, oneDNN splits the work). Otherwise
    any row count, with the AMX GEMM where the CPU has AMX (``amx_bf16``: Intel Xeon 4th generation
    and later) and the AVX512-BF16 one elsewhere (AMD Zen 4: faster than oneDNN at 1 to 64 rows);
    but on an AMX CPU whose library lacks the AMX GEMM, ``GEMM_AMX_ROWS``, since oneDNN's matmul
    runs on the tiles there (1,157 GFLOPS on one core against VDPBF16PS's ~150-230)."""
    if num_threads > 1 and not threaded():
        return GEMM_THREADED_ROWS
    return GEMM_AMX_ROWS if "amx_bf16" in cpu_flags() and not amx_available() else None


def helpers_max_rows(num_threads: int) -> int | None:
    """The most rows ``FusedDecoder`` should run through the layer helpers on ``num_threads``
    intra-op threads (None: any): ``THREADED_ROWS`` with more than one thread when the library runs
    on the calling thread only (built without OpenMP), else any."""
    return THREADED_ROWS if num_threads > 1 and not threaded() else None


def _cache_dir() -> Path:
    if os.environ.get("LLAMARL_CACHE_DIR"):
        return Path(os.environ["LLAMARL_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llamarl"


def build(*, avx512_bf16: bool, amx: bool = False, openmp: bool = True, cache_dir: Path | None = None,
          compiler: str | None = None) -> Path:
    """Compile ``csrc/bf16_decode.c``, ``amx_gemm.c`` and ``softmax.c`` (with the AVX512-BF16 GEMM and vector
    paths when ``avx512_bf16``, the AMX GEMM when ``amx`` too, and the kernels split across threads
    when ``openmp``) once per source, flags and compiler, and return the shared library's path; raise
    ``RuntimeError`` naming the compiler and its first error line when it cannot."""
    compiler = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found ($CC, cc, gcc)")
    if amx and not avx512_bf16:
        raise ValueError("cpu_kernels.build: the AMX GEMM needs the AVX512-BF16 build (avx512_bf16=True)")
    flags = (_FLAGS + (_AVX512_BF16_FLAGS if avx512_bf16 else []) + (_AMX_FLAGS if amx else [])
             + (_OPENMP_FLAGS if openmp else []))
    sources = b"".join(path.read_bytes() for path in (*_SOURCES, *_HEADERS))
    key = hashlib.sha256(sources + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
    target = (cache_dir or _cache_dir()) / f"bf16_decode-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        try:
            done = subprocess.run([compiler, *flags, *map(str, _SOURCES), "-o", partial, "-lm"],
                                  capture_output=True,
                                  text=True, timeout=120, check=False)
        except (OSError, subprocess.TimeoutExpired) as error:
            raise RuntimeError(f"{compiler} could not compile {_SOURCE.name}: {error}") from error
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["(no output)"])[0]
            raise RuntimeError(f"{compiler} failed on {_SOURCE.name}: {first}")
        os.replace(partial, target)  # atomic: a rank compiling beside us gets a whole file too
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The loaded kernels, or None where they cannot run here (module docstring; logged once)."""
    if os.environ.get("LLAMARL_CPU_KERNELS", "1") == "0":
        return None
    avx512_bf16 = cpu_has_avx512_bf16()
    # The most capable build this CPU and compiler allow: without OpenMP (a compiler lacking it) the
    # kernels run on the calling thread; without AMX (an older compiler) the AVX512-BF16 GEMM runs.
    candidates = [(amx, openmp) for amx in ((True, False) if avx512_bf16 and "amx_bf16" in cpu_flags() else (False,))
                  for openmp in (True, False)]
    errors = []
    for amx, openmp in candidates:
        try:
            library = load(build(avx512_bf16=avx512_bf16, amx=amx, openmp=openmp))
        except (OSError, RuntimeError) as error:
            errors.append(str(error))
            continue
        if errors:
            missing = [what for what, lacks in (("the AMX GEMM", candidates[0][0] and not amx),
                                                ("OpenMP threads", not openmp)) if lacks]
            log.warning("the bf16 CPU kernels are built without %s (%s)", " and ".join(missing), errors[0])
        return library
    log.warning("the bf16 CPU decode kernels are not used (%s); PyTorch ops run the decode steps", errors[-1])
    return None


def load(path: Path) -> ctypes.CDLL:
    """The library ``build`` wrote at ``path``, its functions' signatures declared."""
    library = ctypes.CDLL(str(path))
    for name, (argtypes, restype) in _SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = argtypes, restype
    # The tile state is granted per process (arch_prctl): asked once per load, before any tile use.
    library.amx_ready = library.llamarl_has_amx() == 1 and library.llamarl_amx_init() == 0
    # Threads only when the OpenMP runtime the kernels call is the one that forks their regions: a
    # compiler whose -fopenmp links another runtime than the libgomp PyTorch loaded (clang's libomp)
    # would number every thread 0 (shared scratch, a race); OMP_THREAD_LIMIT=1 leaves no team either.
    library.threaded = library.llamarl_has_openmp() == 1 and library.llamarl_parallel_width(2) == 2
    if library.llamarl_has_openmp() == 1 and not library.threaded:
        log.warning("the bf16 CPU kernels' OpenMP runtime gave no team of 2 threads (another runtime than "
                    "PyTorch's libgomp, or OMP_THREAD_LIMIT); they run on the calling thread")
    return library


def available() -> bool:
    """True when the layer helpers (norms, attention, activation) can run here, building them if needed."""
    return _library() is not None


def gemm_available() -> bool:
    """True when ``linear`` can run here (the library was built with the AVX512-BF16 GEMM)."""
    library = _library()
    return library is not None and library.llamarl_has_gemm() == 1


def amx_available() -> bool:
    """True when ``linear`` runs on the AMX tiles here: the library was built with the AMX GEMM and
    Linux granted this process the tile state (``load`` asks)."""
    library = _library()
    return library is not None and library.amx_ready


def _checked(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> int:
    """``t``'s data pointer once it is a contiguous CPU tensor of ``shape`` and ``dtype``; else a
    ``ValueError`` naming the argument (the kernels index raw memory: nothing unchecked reaches them)."""
    if (tuple(t.shape) != shape or t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous()
            or t.layout != torch.strided):
        raise ValueError(f"cpu_kernels: {name} must be a contiguous {dtype} CPU tensor of shape {shape}; got "
                         f"{tuple(t.shape)} {t.dtype} on {t.device}{'' if t.is_contiguous() else ' (not contiguous)'}")
    return t.data_ptr()


def threaded() -> bool:
    """True when the kernels split their work across PyTorch's intra-op threads (built with OpenMP:
    the same libgomp as PyTorch's, so the same pool); False when they run on the calling thread."""
    library = _library()
    return library is not None and library.threaded


def _need() -> ctypes.CDLL:
    library = _library()
    if library is None:
        raise RuntimeError("the bf16 CPU decode kernels are not available here (cpu_kernels.available())")
    return library


def _threads() -> int:
    """The threads a kernel may use: PyTorch's intra-op count, asked per call (a caller may change
    it), where ``threaded()``; else 1."""
    return torch.get_num_threads() if threaded() else 1


def packed_size(out_features: int, in_features: int) -> int:
    """Elements of a ``[out_features, in_features]`` weight in ``linear``'s layout: rows padded to
    panels of 16, columns to pairs."""
    return -(-out_features // 16) * 16 * -(-in_features // 2) * 2


@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A ``[out_features, in_features]`` bf16 weight in ``linear``'s layout (``pack``): panels of 16
    output rows, each input-column pair's 16 x 2 weights side by side, zero-padded; ``data`` is flat."""

    data: torch.Tensor
    out_features: int
    in_features: int

    def __post_init__(self) -> None:
        # ``linear`` hands data's memory to C: its size must be the layout's for these features.
        size = packed_size(self.out_features, self.in_features)
        if self.out_features < 1 or self.in_features < 1:
            raise ValueError(f"PackedWeight: features must be >= 1; got {self.out_features} x {self.in_features}")
        _checked("packed data", self.data, (size,))


def pack(weight: torch.Tensor) -> PackedWeight:
    """``weight`` (bf16, contiguous, CPU, ``[out, in]``) copied into ``linear``'s layout; a copy:
    pack again after the weight changes."""
    library = _need()
    out_features, in_features = weight.shape if weight.dim() == 2 else (-1, -1)
    pointer = _checked("weight", weight, (out_features, in_features))
    data = torch.empty(packed_size(out_features, in_features), dtype=torch.bfloat16, device=weight.device)
    library.llamarl_pack_bf16(pointer, data.data_ptr(), out_features, in_features)
    return PackedWeight(data=data, out_features=out_features, in_features=in_features)


HUGE_PAGE = 2 * 2**20
"""Bytes of a transparent huge page on x86-64 Linux: ``pack_all``'s alignment."""


def pack_all(weights: list[torch.Tensor]) -> list[PackedWeight]:
    """``pack`` of each of ``weights``, all in one allocation on transparent huge pages where the
    system grants them (``madvise(MADV_HUGEPAGE)`` before the packing first touches it; THP set to
    ``madvise`` or ``always``): what a decode step streams from memory once per step, one weight
    after another. On 4 KB pages every 4 KB of that stream is a TLB miss and a stop for the hardware
    prefetchers (the step's time with and without huge pages: docs/benchmarks.md, "The native
    engine on CPU"). The views share the allocation: it lives while any of them does. Up to two huge
    pages (4 MB) more than ``pack``'s."""
    library = _need()
    shapes = [tuple(w.shape) if w.dim() == 2 else (-1, -1) for w in weights]
    pointers = [_checked(f"weight {i}", w, shape) for i, (w, shape) in enumerate(zip(weights, shapes))]
    sizes = [packed_size(n, k) for n, k in shapes]
    if not weights:
        return []
    # The span starts at a 2 MB boundary (the allocator aligns to 64 bytes) and the advice covers
    # whole huge pages up to the span's end rounded up: a huge page of slack holds both ends.
    advised = -(-sum(sizes) * 2 // HUGE_PAGE) * HUGE_PAGE
    raw = torch.empty((advised + HUGE_PAGE) // 2, dtype=torch.bfloat16, device=weights[0].device)
    start = (-raw.data_ptr() % HUGE_PAGE) // 2
    span = raw[start : start + sum(sizes)]
    library.llamarl_advise_huge(span.data_ptr(), advised)
    packed, offset = [], 0
    for pointer, (n, k), size in zip(pointers, shapes, sizes):
        data = span[offset : offset + size]
        library.llamarl_pack_bf16(pointer, data.data_ptr(), n, k)
        packed.append(PackedWeight(data=data, out_features=n, in_features=k))
        offset += size
    return packed


def _output(out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor,
            dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``out`` checked to be a contiguous ``dtype`` CPU tensor of ``shape`` (a caller's reused
    buffer: a fresh tensor's first touch costs page faults, ~0.5 us per 4 KB, a few ms of a 64-row
    step), or a new one on ``like``'s device."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=like.device)
    _checked("out", out, shape, dtype)
    return out


def linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None, *,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``bf16(x @ w.T + bias)`` for ``x`` ``[rows, in]``, the weight ``w`` ``[out, in]`` packed by
    ``pack``, ``bias`` ``[out]`` (bf16, contiguous, CPU); a new ``[rows, out]``. On PyTorch's intra-op
    threads where ``threaded()`` (module docstring); on
    the AMX tiles where ``amx_available()``, else with AVX512-BF16 (the same sums in another order).
    ``out``: written and returned instead of a new tensor (``_output``)."""
    library = _need()
    b = 0 if bias is None else _checked("bias", bias, (weight.out_features,))
    rows = x.shape[0] if x.dim() == 2 else -1
    if rows < 1:
        raise ValueError(f"cpu_kernels.linear takes x of shape [rows >= 1, {weight.in_features}]; got {tuple(x.shape)}")
    pointer = _checked("x", x, (rows, weight.in_features))
    out = _output(out, (rows, weight.out_features), x)
    gemm = library.llamarl_gemm_amx_bf16 if library.amx_ready else library.llamarl_gemm_bf16
    status = gemm(pointer, weight.data.data_ptr(), b, out.data_ptr(), rows, weight.out_features, weight.in_features,
                  _threads())
    if status == 4:
        raise MemoryError(f"cpu_kernels.linear: no memory to pad {rows} rows of {weight.in_features} columns")
    if status == 2:  # the library was built without it (checked here, not by a call per linear)
        raise RuntimeError("the bf16 GEMM needs a CPU with AVX512-BF16 (cpu_kernels.gemm_available())")
    assert status == 0, status
    return out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, *, eps: float) -> torch.Tensor:
    """HF's bf16 RMSNorm of ``x`` ``[rows, dim]`` with ``weight`` ``[dim]``; a new ``[rows, dim]``."""
    library = _need()
    rows, dim = x.shape
    out = torch.empty_like(x)
    library.llamarl_rmsnorm_bf16(_checked("x", x, (rows, dim)), _checked("norm weight", weight, (dim,)),
                                 out.data_ptr(), rows, dim, eps, _threads())
    return out


def add_rmsnorm(hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, *, eps: float,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """The residual add then the next RMSNorm: ``hidden += delta`` in place (bf16), and return
    RMSNorm(hidden) with ``weight``; ``hidden`` and ``delta`` ``[rows, dim]``; into ``out`` if given."""
    library = _need()
    rows, dim = hidden.shape
    out = _output(out, (rows, dim), hidden)
    library.llamarl_add_rmsnorm_bf16(_checked("hidden", hidden, (rows, dim)), _checked("delta", delta, (rows, dim)),
                                     _checked("norm weight", weight, (dim,)), out.data_ptr(), rows, dim, eps,
                                     _threads())
    return out


def silu_mul(gate_up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU's ``bf16(silu(gate)) * up`` for ``gate_up`` ``[rows, 2 * inter]`` = ``[gate | up]``;
    into ``out`` if given."""
    library = _need()
    rows, double = gate_up.shape
    out = _output(out, (rows, double // 2), gate_up)
    library.llamarl_silu_mul_bf16(_checked("gate_up", gate_up, (rows, 2 * (double // 2))), out.data_ptr(), rows,
                                  double // 2, _threads())
    return out


def attention_scratch(*, num_heads: int, num_kv_heads: int, head_dim: int, width: int) -> int:
    """Floats of attention scratch each thread needs (``csrc/kernels.h``'s ``attention_scratch``):
    the scores and the query and output heads of one KV head's query heads, and a row of d."""
    return (num_heads // num_kv_heads) * (width + 2 * head_dim) + head_dim


def attention(qkv: torch.Tensor, *, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
              positions: torch.Tensor, num_heads: int, scaling: float, out: torch.Tensor | None = None,
              q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
              norm_eps: float = 0.0) -> torch.Tensor:
    """One token per row through a layer's attention after its q/k/v projection (``csrc``'s
    ``llamarl_attention_bf16``): RoPE on q and k, the token's key and value written into the cache
    ``keys`` / ``values`` ``[capacity, kv_heads, width, d]`` at column ``positions[r]`` of slot r,
    and grouped-query attention over columns ``0 .. positions[r]``. ``qkv`` ``[rows, (heads + 2 x
    kv_heads) x d]``, ``cos`` / ``sin`` ``[rows, d]``, ``positions`` int64 ``[rows]``, each < width.
    ``q_norm`` / ``k_norm`` (bf16 ``[d]``, both or neither): each query / key head RMS-normalized
    over d with that weight and ``norm_eps`` before its RoPE, as Qwen3's ``q_norm`` / ``k_norm``.
    Returns ``[rows, heads x d]`` (``out`` if given)."""
    library = _need()
    capacity, num_kv_heads, width, head_dim = keys.shape
    rows = qkv.shape[0]
    if rows > capacity or num_heads % num_kv_heads or head_dim > 512 or head_dim % 2:
        raise ValueError(f"cpu_kernels.attention: {rows} rows in a cache of {capacity} slots, {num_heads} heads over "
                         f"{num_kv_heads} KV heads of dimension {head_dim} (at most 512, even)")
    pointers = [_checked("qkv", qkv, (rows, (num_heads + 2 * num_kv_heads) * head_dim)),
                _checked("cos", cos, (rows, head_dim)), _checked("sin", sin, (rows, head_dim)),
                _checked("keys", keys, (capacity, num_kv_heads, width, head_dim)),
                _checked("values", values, (capacity, num_kv_heads, width, head_dim)),
                _checked("positions", positions, (rows,), torch.int64)]
    if (q_norm is None) != (k_norm is None):
        raise ValueError("cpu_kernels.attention: q_norm and k_norm come together (Qwen3's q / k norms), got one")
    norms = [_checked(name, weight, (head_dim,)) if weight is not None else None
             for name, weight in (("q_norm", q_norm), ("k_norm", k_norm))]
    out = _output(out, (rows, num_heads * head_dim), qkv)
    threads = _threads()
    scratch = torch.empty(threads * attention_scratch(num_heads=num_heads, num_kv_heads=num_kv_heads,
                                                      head_dim=head_dim, width=width),
                          dtype=torch.float32, device=qkv.device)
    status = library.llamarl_attention_bf16(*pointers, out.data_ptr(), scratch.data_ptr(), rows, num_heads,
                                            num_kv_heads, head_dim, width, scaling, *norms, norm_eps, threads)
    if status != 0:
        raise ValueError(f"cpu_kernels.attention: a position in {positions.tolist()} is outside the cache's "
                         f"{width} columns")
    return out


def softmax(logits: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.softmax(logits, -1, dtype=torch.float32)`` for bf16 ``logits`` ``[rows, vocab]``
    (``csrc/softmax.c``: within ~2e-6 relative; a -inf logit gets exactly 0), written into ``out``
    (fp32, contiguous, ``[rows, vocab]``) when given, else into a new tensor; rows split across
    PyTorch's intra-op threads where ``threaded()``."""
    library = _need()
    rows, vocab = logits.shape if logits.dim() == 2 else (-1, -1)
    pointer = _checked("logits", logits, (rows, vocab))
    out = _output(out, (rows, vocab), logits, torch.float32)
    library.llamarl_softmax_bf16(pointer, out.data_ptr(), rows, vocab, _threads())
    return out


def sample(logits: torch.Tensor, uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One token per row of bf16 ``logits`` ``[rows, vocab]`` drawn from their softmax with the
    row's uniform (fp64 ``[rows]`` in [0, 1)), and its fp32 log-probability: ``sampling._draw`` over
    ``softmax``'s probabilities without writing them (``csrc/softmax.c``; the same draw up to
    rounding at an interval's edge, the log-prob within ~1e-6). A row with a NaN or +inf logit (or
    only -inf ones) has nothing to draw from: ``ValueError`` naming the rows (PyTorch's softmax is NaN
    there). None when the vocabulary is over the kernel's 2M (the caller keeps PyTorch's path)."""
    library = _need()
    rows, vocab = logits.shape if logits.dim() == 2 else (-1, -1)
    pointer = _checked("logits", logits, (rows, vocab))
    draws = _checked("uniforms", uniforms, (rows,), torch.float64)
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if library.llamarl_sample_bf16(pointer, draws, tokens.data_ptr(), logprobs.data_ptr(), rows, vocab, _threads()):
        return None
    if bool((tokens < 0).any()):  # the kernel's mark for a row without a distribution
        bad = (tokens < 0).nonzero().flatten().tolist()
        raise NonFiniteLogits(f"cpu_kernels.sample: logits rows {bad[:8]} hold a NaN or +inf (or only -inf): "
                         f"nothing to draw from (non-finite weights or activations?)")
    return tokens, logprobs
