"""Low-precision training kernels: MXFP8 formats and mixture-of-experts layers.

- ``opencomposer.kernels.mx``: OCP MX v1.0 quantization (``quantize`` -> ``MXTensor``),
  ``mx_mm`` and ``MXLinear``.
- ``opencomposer.kernels.moe``: top-k router, permutation, ``GroupedExperts`` (grouped
  GEMMs with the per-expert loop as reference), ``MoE``, aux losses.
- ``opencomposer.kernels.convert``: ``to_mxfp8_training`` (the trainer's hook), which
  swaps a model's linears and expert banks for their MXFP8 forms.
- ``opencomposer.kernels.train_tiny``: a tiny MoE language model and its training loop,
  for tests and benchmarks.

Imports torch only; nothing is imported here so ``import opencomposer.kernels`` is free.
"""
