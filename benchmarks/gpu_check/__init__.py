"""``make gpu-check``: llamarl's engine and trainer on one GPU, in three prepared parts of <= 300 s each.

    make gpu-check PART=engine      # python3 benchmarks/gpu_check --part engine: decode at three shapes
    make gpu-check PART=run         # the colocated 256 x 256 tick at 135M and 1.5B
    make gpu-check PART=trainer     # training steps: 135M and 1.5B full fine-tuning, 7B LoRA rank 16
    make gpu-check PART=tests       # optional, outside the 15 minutes: tests/gpu and the default recipe
    .venv/bin/python benchmarks/gpu_check --smoke [--part run --smoke-runs | --part trainer]   # CPU dry run

Each part is a plan of sections with timeouts (``common.PARTS``; engine, run, trainer: timeouts + start-up
<= 300 s, tested on CPU), each section a process of its own on a GPU: one that fails or times out is
recorded with its error and what it measured before, and the next runs. One report per part,
``runs/gpu-check-<part>-<time>/report.txt`` and ``report.json`` (``--out``), a log per section.

* ``engine``: ``shape:<name>`` for random-init models of SmolLM2-135M, Qwen2.5-1.5B and Qwen2.5-7B
  built on the device (device_sections.py): the probes (copy GB/s, bf16 GEMM TFLOPS, µs per
  replayed kernel: probes.py), decode ms a step at 64 and 256 rows, state widths 512 and 1024,
  greedy and sampled, each over its bound with the live KV read (bounds.py) and over its kernel
  floor, prefill tokens/s, the ladder's capture seconds, one profiled step (kernels, histogram).
* ``run``: ``tick:<name>``, a colocated tick of 256 samples x 256 new tokens through the recipe's
  pipeline (run_child.py: no tyro, tensorboard or matplotlib needed), at 135M and 1.5B: generated
  tokens/s over the tick's bound, trainer tokens/s and MFU, peak memory (at 1.5B over the device's:
  issue 46's "fits with the generator resident").
* ``trainer``: ``train:<name>``, llamarl's ``TrainerExecutor`` stepping on a random-init model built
  on the device (trainer_sections.py), 16,384-token micro-batches, shared prompts on and off: tokens/s,
  TFLOP/s by the trainer's own count, MFU over the data sheet and over the GEMM probe, peak memory.
* ``tests``: ``pytest tests/gpu`` and the default recipe colocated (time to 0.70 accuracy).

Every target of issues 45 and 46 stands beside its number, met / MISSED / not measured (checks.py); a
missed target is a finding, not a failure: the command exits 1 only when a section errs or times
out. Where the Python has no torch or no CUDA (``GPU_PY``, default ``python3``; then the project's
``.venv/bin/python`` is tried) it prints one line saying so and exits 0.
"""
