"""Low-precision training kernels: MXFP8 formats and mixture-of-experts layers.

- ``opencomposer.kernels.mx``: OCP MX v1.0 quantization (``quantize`` -> ``MXTensor``),
  ``MXLinear`` and ``to_mxfp8_training`` (the trainer's hook).
- ``opencomposer.kernels.moe``: top-k router, permutation, ``GroupedExperts`` (grouped
  GEMMs with the per-expert loop as reference), ``MoE``, aux losses.
- ``opencomposer.kernels.tiny``: a tiny MoE language model and loop for tests/benchmarks.

Imports torch only; nothing is imported here so ``import opencomposer.kernels`` is free.
"""
