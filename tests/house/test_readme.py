"""The README's researcher example (the pure functions under the engine) runs as printed, with the names of the
rooms, and its two forms (per-layer and stacked weights) give the same logits."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]


def test_the_readme_pure_function_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    example = next(b for b in blocks if "graphs.jit_decode_window(cfg)" in b)
    scope: dict = {}
    # the first window's logits, kept before the example rebinds `logits` for the stacked form
    first = example.replace("# one scanned layer body", "first_logits = logits\n# one scanned layer body", 1)
    exec(compile(first, "README.md", "exec"), scope)
    a, b = np.asarray(scope["first_logits"]), np.asarray(scope["logits"])
    assert a.shape == b.shape == (3, scope["cfg"].vocab_size) and np.isfinite(a).all()
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
