"""Weight sinks: how a weights channel hands a stream of weights to an executor that loads them itself.

An inbound executor whose ``weight_sink()`` returns a callable (a vLLM generator: it keeps no HF
copy of the model) is handed an iterator of ``(name, tensor)`` instead of having its parameters
written in place. Both weights channels (``llamarl/channels/weights.py`` over the network,
``llamarl/channels/in_memory.py`` between co-resident executors) feed it here: the stream is run to
its end whatever the sink does, because its collectives are what the peers wait on. The tensors
come from the channel (DDMA rounds, or ``llamarl/models/weight_copy.py``'s plain functions);
models never call back into this module.
"""

from __future__ import annotations


def drain(iterator) -> int:
    """Run ``iterator`` to its end (its remaining collectives with it); the number of items left."""
    return sum(1 for _ in iterator)


def weight_sink_of(executor):
    """The executor's ``weight_sink()`` (a callable that loads a stream of weights), or None for
    an executor whose parameters the weight channels write in place."""
    return executor.weight_sink() if hasattr(executor, "weight_sink") else None


def feed(sink, named_tensors, *, label: str) -> int:
    """Hand ``named_tensors`` (an iterator of ``(name, tensor)``) to ``sink`` (a weight sink's
    callable: it loads them as they come), then run whatever it left unconsumed, so that ranks
    whose collectives drive the iterator are never left waiting: a sink that raised has its error
    re-raised after that, one that stopped early is a RuntimeError. ``sink`` None: the iterator is
    only run (it writes in place). Returns the bytes of the tensors handed over."""
    if sink is None:
        drain(named_tensors)
        return 0
    counted = [0]

    def counting():
        for name, tensor in named_tensors:
            counted[0] += tensor.numel() * tensor.element_size()
            yield name, tensor

    stream = counting()
    try:
        sink(stream)
    except BaseException:
        drain(stream)  # the peers are mid-sync: let them finish it, then report the sink's error
        raise
    left = drain(stream)
    if left:
        raise RuntimeError(f"{label}: the weight sink stopped {left} tensors before the end of the stream")
    return counted[0]
