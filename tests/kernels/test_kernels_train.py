"""The MXFP8 training bound: a tiny MoE language model trained 200 steps in bf16 and in
MXFP8 (emulated) from the same init on the same batches ends within 3% in loss.
Slow (minutes on 2 shared cores): ``pytest -m slow tests/kernels/test_kernels_train.py``."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from opencomposer.kernels.train_tiny import TinyMoELM, TrainConfig, train

ROOT = Path(__file__).resolve().parents[2]


def corpus() -> bytes:
    return b"".join(p.read_bytes() for p in sorted(ROOT.glob("kernels/*.py")))


def test_each_precision_starts_from_the_same_loss():
    text = corpus()
    small = TinyMoELM.Config(dim=64, heads=2, hidden=64, layers=1, experts=4, seq=32)
    first = {
        p: train(TrainConfig(steps=1, batch=4, precision=p, model=small), text)[0]
        for p in ("bf16", "mxfp8", "fp32")
    }
    assert abs(first["bf16"] - first["fp32"]) / first["fp32"] < 0.01
    assert abs(first["mxfp8"] - first["fp32"]) / first["fp32"] < 0.01
    assert first["mxfp8"] != first["bf16"]  # the GEMMs really were quantized


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_mxfp8_final_loss_within_3_percent_of_bf16():
    text = corpus()
    final = {}
    for precision in ("bf16", "mxfp8"):
        losses = train(TrainConfig(steps=200, precision=precision), text)
        assert losses[-1] < 0.7 * losses[0], (precision, losses[0], losses[-1])  # it learned
        final[precision] = statistics.mean(losses[-20:])
    gap = abs(final["mxfp8"] - final["bf16"]) / final["bf16"]
    assert gap < 0.03, final
