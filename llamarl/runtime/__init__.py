"""The runtime every layer stands on: the payload (``batch``), shard boxes, the name registry, the
logger, the job's errors, checkpoint files and sharded state, metrics, the progress line, the
training-sample log, a run's identity, the world (ranks, devices, process groups, placement,
preflight, liveness, the shared run directory) and the ``Executor`` contract. It imports nothing of
llamarl outside this folder, so any layer may use it."""
