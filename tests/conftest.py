"""Test-session environment, set before anything imports torch, triton or the hub clients."""

import os

# Triton kernels can only run under the interpreter here (no GPU); the variable must be set
# before any @triton.jit decorator runs, i.e. before baton.kernels is imported anywhere.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Nothing may reach a model or dataset hub: fail fast instead of waiting on the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
