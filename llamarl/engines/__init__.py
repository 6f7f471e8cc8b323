"""Generation engines behind one contract (llamarl/engines/base.py); importing this package registers
the built-in ones: ``torch`` (native) and ``vllm`` (vLLM is itself imported only when that engine is built)."""

from llamarl.engines import torch_engine, vllm_engine  # noqa: F401 - each module registers its engine
