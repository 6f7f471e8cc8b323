"""Generation engines behind one contract (llamarl/engines/base.py); importing this package registers
the built-in ones' settings (llamarl/engines/engine_configs.py): ``torch`` (native) and ``vllm``. An
engine's implementation (and vLLM itself) is imported only when that engine is built."""

from llamarl.engines import engine_configs  # noqa: F401 - registers the built-in engines
