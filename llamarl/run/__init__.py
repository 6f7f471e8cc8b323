"""A run: the pipeline described as data (``stages.py``: stages and channels), the controller that
ticks its executors (``controller.py``), ``run_pipeline`` (``runner.py``) and the runner's objects:
the run directory, the evaluations, the per-tick log, checkpoints and exports, the summary, the
Weights & Biases logger; and the launcher the torchrun scripts start (``launch.py``)."""
