"""3D parallelism for the one shared model, applied from outside (torchtitan style).

layout.py (dp x pp x cp x tp, checked before anything starts) -> mesh.py (the device mesh) ->
parallelize.py (pipeline.py stages, tensor_parallel.py TP/SP, context_parallel.py ring attention,
recomputation, data_parallel.py FSDP2/DDP; the training step) -> checkpoint.py (DCP, any layout
to any layout, and export). baton.train.backends.torch3d plugs it into the training loop.
"""
