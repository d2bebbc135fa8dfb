"""The serving engine: requests in, one mixed forward per step, tokens out.

Six short files, in the order a request passes through them:

- ``config.py``: ``EngineConfig`` (every option, checked as a whole) and the registry of
  attention backends;
- ``inputs.py``: ``InputProcessor``, a prompt and its parameters → a checked ``Request``;
- ``core.py``: ``EngineCore``, one step = schedule → run → commit, all or nothing (and the
  engine's typed ``EngineStats`` and ``EngineLoad``);
- ``runner.py``: ``ModelRunner``, the step's batch, the attention step, the forward and
  sampling, returned as a ``RunnerOutput`` (the only code that runs a model, the draft
  model's included);
- ``outputs.py``: ``OutputRouter`` and ``RequestStream``, each output to its request's owner;
- ``llm_engine.py``: ``LLMEngine`` and ``LLM``, the front doors that wire the rest.

Beside them: ``pool_size.py`` (how many pages the memory holds, decided at the build) and
``generate.py`` (one request alone, without the scheduler: the batching oracle).
"""

from tiny_llm.engine.config import (
    ATTENTION_BACKENDS,
    DEFAULT_ATTENTION,
    KV_CACHES,
    EngineConfig,
)
from tiny_llm.engine.inputs import CHAT_ROLES, ContextLengthError, Prompt
from tiny_llm.engine.llm_engine import LLM, LLMEngine
from tiny_llm.engine.outputs import RequestStream

__all__ = [
    "ATTENTION_BACKENDS",
    "CHAT_ROLES",
    "DEFAULT_ATTENTION",
    "KV_CACHES",
    "LLM",
    "ContextLengthError",
    "EngineConfig",
    "LLMEngine",
    "Prompt",
    "RequestStream",
]
