"""baton.serve: the inference engine and server.

`from baton.serve import LLM, SamplingParams` (vLLM's import) loads them on first use, so that
`import baton.serve.<module>` stays as cheap as that module. Importing it also chooses how
OpenMP's threads wait (serve/openmp.py), which has to happen before torch is loaded.
"""

import importlib

from baton.serve import openmp

openmp.configure()  # before anything here imports torch: libgomp reads its wait policy once, at load

_LAZY = {"LLM": "baton.serve.llm", "SamplingParams": "baton.serve.sampling_params"}
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
