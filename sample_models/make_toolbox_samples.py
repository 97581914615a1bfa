"""Regenerate the two tiny torch dynamo exports that tests/test_toolbox.py runs through onnx_ir's PassManager.

* ``toolbox/postnorm_dynamo_op18.onnx``  a BERT-style residual block whose LayerNorm is written as math, with a
  scale of 1 (``* 1.0``, a no-op an optimizer removes), exported with ``optimize=False`` so that the Mul stays.
* ``toolbox/residual_dynamo_op20.onnx``   ``nn.LayerNorm(dense(x) + x)``: exports as a LayerNormalization node after
  the residual Add.

Beside each model, ``<name>.npz`` holds the input ``x`` (float32 [2, 5, 16]) and torch's own output ``expected``, so
the tests compare the fused model with torch's numbers without importing torch.

They live in a folder of their own so that the tests and benchmarks that take every ``sample_models/*.onnx`` do not
pick them up. torch is needed only to regenerate them (CPU build, see docs/development.md):

    pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
    python sample_models/make_toolbox_samples.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import torch

OUT_DIR = Path(__file__).resolve().parent / "toolbox"


class PostNorm(torch.nn.Module):
    """A BERT-style residual block with its LayerNorm written as math, and a scale of 1 (a no-op an optimizer
    removes); torch's exporter keeps both as they are with ``optimize=False``."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.dense = torch.nn.Linear(hidden, hidden)
        self.weight = torch.nn.Parameter(torch.rand(hidden) + 0.5)
        self.bias = torch.nn.Parameter(torch.rand(hidden))
        self.scale = 1.0

    def forward(self, x):
        h = self.dense(x) * self.scale + x
        mean = h.mean(-1, keepdim=True)
        var = (h - mean).pow(2).mean(-1, keepdim=True)
        return (h - mean) / torch.sqrt(var + 1e-5) * self.weight + self.bias


class Residual(torch.nn.Module):
    """nn.LayerNorm after a residual Add: the exporter writes LayerNormalization."""

    def __init__(self):
        super().__init__()
        self.dense, self.norm = torch.nn.Linear(16, 16), torch.nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(self.dense(x) + x)


def _write(name: str, module: torch.nn.Module, **export_options) -> None:
    torch.manual_seed(0)
    module = module.eval()
    x = torch.randn(2, 5, 16)
    program = torch.onnx.export(module, (x,), dynamo=True, verbose=False, **export_options)
    with torch.no_grad():
        expected = module(x).numpy()
    ir.save(program.model, OUT_DIR / f"{name}.onnx")
    np.savez(OUT_DIR / f"{name}.npz", x=x.numpy(), expected=expected)
    print(f"wrote {OUT_DIR / name}.onnx (+ .npz)")


def main() -> None:
    OUT_DIR.mkdir(exist_ok=True)
    torch.manual_seed(0)
    _write("postnorm_dynamo_op18", PostNorm(), opset_version=18, optimize=False)
    torch.manual_seed(0)
    _write("residual_dynamo_op20", Residual(), opset_version=20)


if __name__ == "__main__":
    main()
