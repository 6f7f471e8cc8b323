"""The native engine's CPU plugin: the fused Llama-family decode step (``fused_decode.py``), its C
kernels for bf16 (``cpu_kernels.py``, sources in ``csrc/``, compiled on first use; a step's layers
in one C call: ``native_step.py``) and the sampler's C fast paths (``sampling.py``).

Imported only when the model or the logits are on the CPU (``TorchEngine`` imports it lazily): a
CUDA run never loads it, and the general sampler (``llamarl/engines/sampling.py``) imports no C.
"""
