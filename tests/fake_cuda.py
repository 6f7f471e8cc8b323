"""CPU proxies for what only CUDA runs: fakes of CUDA graphs, their memory pools and streams that
check lifetimes, and a counter of dispatched ops and host synchronisations.

``FakeCudaGraphs`` replaces ``torch.cuda.CUDAGraph``, ``torch.cuda.graph``,
``torch.cuda.graph_pool_handle`` and the stream functions a capture uses. A capture records every
aten op run inside ``with torch.cuda.graph(...)`` (a ``TorchDispatchMode``) and ``replay()`` runs
the tape again on the very tensors it recorded, writing each op's result into the tensor the
capture produced: like a real graph, a replay reads its inputs and parameters at their captured
addresses (an in-place write is seen, a rebound parameter is not) and writes its captured
outputs. What a real capture refuses, the fake refuses too, with the allocator's words:

* capturing into a pool whose graphs have all died (``CUDACachingAllocator`` asserts
  ``use_count > 0``: the crash of the first GPU runs);
* a host read of a device value during a capture (``.item()``, ``bool()``, ``.tolist()``, and the
  ops whose output size depends on values: ``nonzero``, boolean-mask indexing, ``unique``).

A fake pool also knows which memory it owns: every tensor an op allocates during a capture into it
(an output whose storage is none of the op's inputs', so not a view, an in-place result or an
``out=`` write) lives in the pool on a GPU, where a later capture into the same pool may reuse it
(``FakeCudaGraphs.owned_by_pool``).

A fake graph also lists the kernels a real one would replay (``FakeGraph.kernels``): every aten op
of its tape but views and bare allocations (no kernel on a GPU), where the ops of one
``torch.nn.functional.rms_norm`` call count once (on CUDA it is one fused kernel,
``aten._fused_rms_norm``, which decomposes into six ops on the CPU) plus one copy when its input is
not contiguous (the CUDA kernel makes it so first).

``OpCounter`` counts the aten ops dispatched and the host reads (``aten._local_scalar_dense``,
behind ``.item()`` / ``bool()`` / ``int()``, and ``Tensor.tolist``) by phase (``phase(name)``).
On a GPU each host read is a device synchronisation; on this CPU they are free, which is why the
proxy counts them instead of timing them.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_HOST_READ = torch.ops.aten._local_scalar_dense.default
# Ops whose output size depends on values: on a GPU they read a count back to the host.
_DATA_DEPENDENT = {torch.ops.aten.nonzero.default, torch.ops.aten.masked_select.default,
                   torch.ops.aten._unique2.default, torch.ops.aten.unique_dim.default,
                   torch.ops.aten.unique_consecutive.default}


# Ops that launch no kernel on a GPU besides views: allocations without a fill.
_NO_KERNEL = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default,
              torch.ops.aten.lift_fresh.default}
_INDEXING = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put_.default, torch.ops.aten.index_put.default}


def _reads_on_host(func, args) -> bool:
    """Whether ``func(*args)`` reads a device value on the host on a GPU: a scalar read, an op whose
    output size depends on values, or indexing by a boolean mask (a ``nonzero`` inside)."""
    if func is _HOST_READ or func in _DATA_DEPENDENT:
        return True
    if func in _INDEXING and len(args) > 1:
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
    return False


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor) and t.numel()}


class _Tape(TorchDispatchMode):
    """Records (op, args, kwargs, outputs) during a capture and the storages its ops allocate
    (``allocated``); refuses host reads."""

    def __init__(self) -> None:
        super().__init__()
        self.entries: list = []
        self.allocated: set[int] = set()
        self.kernels: list[str] = []
        self.fused: str | None = None  # the CUDA-fused call being recorded (_CudaFusions)
        self.fused_counted = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _reads_on_host(func, args):
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing "
                               f"(fake: {func} reads a device value on the host during a CUDA graph capture)")
        out = func(*args, **kwargs)
        self.entries.append((func, args, kwargs, out))
        self.allocated |= _storages(tree_flatten(out)[0]) - _storages(tree_flatten((args, kwargs))[0])
        if self.fused is not None:
            if not self.fused_counted:
                self.kernels.append(self.fused)
                self.fused_counted = True
        elif not func.is_view and func not in _NO_KERNEL:
            self.kernels.append(func.__name__)
        return out


class _CudaFusions(TorchFunctionMode):
    """Marks on ``tape`` the calls CUDA runs as one kernel (module docstring)."""

    def __init__(self, tape: _Tape) -> None:
        super().__init__()
        self.tape = tape

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.nn.functional.rms_norm or self.tape.fused is not None:
            return func(*args, **kwargs)
        if not args[0].is_contiguous():
            self.tape.kernels.append("contiguous (rms_norm's input)")
        self.tape.fused, self.tape.fused_counted = "rms_norm (fused)", False
        try:
            return func(*args, **kwargs)
        finally:
            self.tape.fused = None


class FakePool:
    """A ``graph_pool_handle``: alive while a graph captured into it is."""

    def __init__(self) -> None:
        self.live_graphs = 0
        self.captured = 0
        self.storages: set[int] = set()
        """Storages allocated by the captures into this pool (the tapes keep them alive)."""


class FakeGraph:
    """A ``torch.cuda.CUDAGraph`` whose ``replay`` re-runs the recorded tape."""

    def __init__(self, harness: FakeCudaGraphs) -> None:
        self.harness = harness
        self.tape: list | None = None
        self.replays = 0
        self.kernels: list[str] = []
        """The kernels a real graph of this capture replays, in order (module docstring)."""

    def replay(self) -> None:
        if self.tape is None:
            raise RuntimeError("fake CUDA graph: replay before capture")
        self.replays += 1
        self.harness.replays += 1
        with torch.no_grad():
            for func, args, kwargs, out in self.tape:
                result = func(*args, **kwargs)
                inputs = _storages(tree_flatten((args, kwargs))[0])
                for mine, fresh in zip(tree_flatten(out)[0], tree_flatten(result)[0]):
                    # Views and in-place results alias their inputs: already written where they live.
                    if isinstance(mine, torch.Tensor) and mine.numel() and \
                            mine.untyped_storage().data_ptr() not in inputs:
                        mine.copy_(fresh)


class FakeStream:
    def __init__(self, device=None, **_) -> None:
        self.device = device

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass


class FakeCudaGraphs:
    """Installs the fakes (module docstring) with ``monkeypatch``; keeps what it saw: every graph
    (weakly: ``live_graphs``), captures, replays."""

    def __init__(self, monkeypatch) -> None:
        self.graphs: weakref.WeakSet[FakeGraph] = weakref.WeakSet()
        self.pools: list[FakePool] = []
        self.captures = 0
        self.replays = 0
        self.capturing = False
        self._private: list[FakePool] = []  # the private pools of captures given pool=None
        monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda *a, **k: FakeGraph(self))
        monkeypatch.setattr(torch.cuda, "graph", self._graph)
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", self._pool_handle)
        monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
        monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream(device))
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: None)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    @property
    def live_graphs(self) -> int:
        return len(self.graphs)

    def owned_by_pool(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s memory was allocated inside a capture (module docstring): on a GPU,
        memory of a graph pool that another capture into that pool may hand out again."""
        return any(tensor.untyped_storage().data_ptr() in pool.storages for pool in (*self.pools, *self._private))

    def _pool_handle(self) -> FakePool:
        pool = FakePool()
        self.pools.append(pool)
        return pool

    @contextlib.contextmanager
    def _graph(self, cuda_graph: FakeGraph, pool: FakePool | None = None, stream=None,
               capture_error_mode: str = "global"):
        if pool is not None and pool.captured and not pool.live_graphs:
            raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED at CUDACachingAllocator.cpp "
                               "(fake: a capture into a pool whose graphs have all died)")
        if self.capturing:
            raise RuntimeError("fake CUDA graph: a capture inside a capture")
        pool = pool or FakePool()  # pool=None: a private pool of its own
        tape = _Tape()
        self.capturing = True
        tolist = torch.Tensor.tolist

        def refused(tensor):
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing (fake: tolist)")

        torch.Tensor.tolist = refused
        try:
            with _CudaFusions(tape), tape:
                yield
        finally:
            self.capturing = False
            torch.Tensor.tolist = tolist
        cuda_graph.tape, cuda_graph.kernels = tape.entries, tape.kernels
        pool.storages |= tape.allocated
        if pool not in self.pools:
            self._private.append(pool)
        pool.captured += 1
        pool.live_graphs += 1
        weakref.finalize(cuda_graph, _graph_died, pool)
        self.graphs.add(cuda_graph)
        self.captures += 1


def _graph_died(pool: FakePool) -> None:
    pool.live_graphs -= 1


class OpCounter(TorchDispatchMode):
    """Counts aten ops and host reads by phase (module docstring). Use as a context manager; label
    code with ``with counter.phase("name")``; ``ops[name]`` / ``reads[name]`` are the counts."""

    def __init__(self) -> None:
        super().__init__()
        self.current = "other"
        self.ops: dict[str, int] = {}
        self.reads: dict[str, int] = {}
        self._tolist = None

    @contextlib.contextmanager
    def phase(self, name: str):
        outer, self.current = self.current, name
        try:
            yield
        finally:
            self.current = outer

    def _read(self) -> None:
        self.reads[self.current] = self.reads.get(self.current, 0) + 1

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        counter, original = self, self._tolist

        def tolist(tensor):
            counter._read()
            return original(tensor)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _reads_on_host(func, args):
            self._read()
        else:
            self.ops[self.current] = self.ops.get(self.current, 0) + 1
        return func(*args, **(kwargs or {}))
