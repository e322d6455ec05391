"""The plugin's own Triton kernels for the CUDA hot path.

* :mod:`.predict`: next-layer routing prediction in one launch (``quasi_hidden`` and
  ``router``): default-vector gather and weighted sum, residual estimate, the next
  layer's RMSNorm, router GEMV, softmax and top-k.
* :mod:`.slots`: the id -> slot map updated on the device, and several experts copied
  from the (UVA-mapped, pinned) slow tier into their slots in one launch.
* :mod:`.dequantize`: a quantized checkpoint's packed experts (AWQ, GPTQ,
  pack-quantized, FP8) into bf16 weights, the same bits as
  :mod:`~vllm_specexpert.quant_formats`' own dequantize.

Kernels only: the tests hold a torch reference of each (``tests/interpreted``), run every
kernel under ``TRITON_INTERPRET=1`` on CPU tensors against it, and compile it ahead of
time for sm_80 and sm_90 (``tests/triton_aot.py``); none has run on a GPU. Nothing here
is imported on the CPU build's runtime path.
"""
