"""Relevance with the real all-MiniLM-L6-v2 (slow: loads the model)."""

from __future__ import annotations

from pathlib import Path

import pytest
from opencomposer.index import CodebaseIndex


@pytest.mark.slow
def test_minilm_ranks_the_described_function_first(workspace: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.delenv("OPENCOMPOSER_EMBEDDER", raising=False)
    (workspace / "src/geometry.py").write_text(
        "import math\n\n\ndef polygon_area(points):\n"
        + "    total = 0.0\n" * 3
        + "    for (x1, y1), (x2, y2) in zip(points, points[1:] + points[:1]):\n"
        "        total += x1 * y2 - x2 * y1\n    return abs(total) / 2\n\n\n"
        "def distance(a, b):\n    return math.hypot(a[0] - b[0], a[1] - b[1])\n"
    )
    index = CodebaseIndex.open(workspace)
    assert index.embedder.config.folder.name == "model"  # the wheel's MiniLM
    index.refresh()
    top = index.search("surface enclosed by a shape given its corners", k=3)
    assert top[0].path == "src/geometry.py" and "polygon_area" in top[0].symbol
    assert (
        index.search("wait longer after each failed attempt", k=1)[0].symbol == "retry_with_backoff"
    )
    dense = index.dense_search("stop calling a service that keeps failing", n=3)
    assert index._meta[dense[0]][0] == "src/retry.py"
