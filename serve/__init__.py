"""baton.serve: the inference engine and server.

`from baton.serve import LLM, SamplingParams` (vLLM's import) loads them on first use, so that
`import baton.serve.<module>` stays as cheap as that module.
"""

import importlib

_LAZY = {"LLM": "baton.serve.llm", "SamplingParams": "baton.serve.sampling_params"}
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
