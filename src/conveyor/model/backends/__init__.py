"""The compute backends a model runs on, one chosen per model at load (``model/device.py``'s
``select_kernels``): ``TorchBackend`` (plain torch, any device), ``CpuBackend`` (the C++
kernels of ``model/kernels/``) and ``TritonBackend`` (the Triton kernels of
``model/kernels/triton/``, the CUDA path). A backend provides the step metadata and the
attention, norm, rotary and activation ops; the model's layers call it and decide nothing
about devices themselves."""
