"""Runs a scheduled batch through the model: the Runner interface (interface.py) and the in-process
ModelRunner with its step plan, input batch, paged attention backends, C++ CPU layers, fused
passes, KV budget and state pools; runner wrappers installed from outside (CALM early exit,
LayerSkip's late entry)."""
