"""Benchmark: fuse LLaMA-shaped models whose weights live in external data (13 GB and 2.8 GB), and print a table.

    python benchmarks/huge_model.py [--out /tmp/lnfuse-bench] [--configs 7b,2.8gb]

Each model is generated once (the data file is created sparse and only the norm weights are written, so
generation takes seconds); lnfuse then runs in a child process with verification on, and the child's wall time and
peak RSS (``wait4``) are reported. Goal: under 30 s and under 1 GB peak RSS on 2 cores for the 13 GB model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
from onnx import TensorProto
from onnx.external_data_helper import set_external_data


@dataclass(frozen=True)
class Config:
    name: str
    layers: int
    hidden: int = 4096
    intermediate: int = 11008
    vocab: int = 32000


CONFIGS = {"7b": Config("llama-7b-shaped", 32), "2.8gb": Config("llama-6-layers", 6)}


class _Builder:
    """Graph plus one external data file; big weights are left as holes in a sparse file."""

    def __init__(self, data_path: Path):
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.data_path = data_path
        self.offset = 0
        self.small: list[tuple[int, bytes]] = []
        self.count = 0

    def weight(self, name: str, shape: list[int], values: np.ndarray | None = None) -> str:
        tensor = onnx.TensorProto(name=name, data_type=TensorProto.FLOAT16, dims=shape, raw_data=b"\0")
        length = int(np.prod(shape)) * 2
        set_external_data(tensor, self.data_path.name, self.offset, length)
        tensor.ClearField("raw_data")
        tensor.data_location = TensorProto.EXTERNAL
        if values is not None:
            self.small.append((self.offset, values.astype(np.float16).tobytes()))
        self.offset += (length + 63) // 64 * 64
        self.inits.append(tensor)
        return name

    def op(self, op_type: str, inputs: list[str], **attrs) -> str:
        self.count += 1
        out = f"{op_type.lower()}_{self.count}"
        self.nodes.append(oh.make_node(op_type, inputs, [out], name=f"{op_type}_{self.count}", **attrs))
        return out

    def rms_norm(self, x: str, prefix: str, hidden: int, rng: np.random.Generator) -> str:
        """HF LlamaRMSNorm as the legacy exporter writes it in fp16."""
        xf = self.op("Cast", [x], to=TensorProto.FLOAT)
        var = self.op("ReduceMean", [self.op("Pow", [xf, "two"])], axes=[-1])
        inv = self.op("Div", ["one", self.op("Sqrt", [self.op("Add", [var, "eps"])])])
        normed = self.op("Cast", [self.op("Mul", [xf, inv])], to=TensorProto.FLOAT16)
        gamma = self.weight(f"{prefix}.weight", [hidden], rng.uniform(0.5, 1.5, hidden))
        return self.op("Mul", [gamma, normed])

    def finish(self) -> None:
        with open(self.data_path, "wb") as f:
            f.truncate(self.offset)  # sparse: untouched weights cost no disk and no time
            for offset, data in self.small:
                f.seek(offset)
                f.write(data)


def generate(config: Config, folder: Path) -> tuple[Path, int]:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{config.name}.onnx"
    data = folder / f"{config.name}.data"
    if path.exists() and data.exists():
        return path, data.stat().st_size
    rng = np.random.default_rng(0)
    b = _Builder(data)
    h, m = config.hidden, config.intermediate
    b.inits += [onnx.numpy_helper.from_array(np.array(v, np.float32), n)
                for n, v in (("two", 2.0), ("one", 1.0), ("eps", 1e-6))]
    x = b.op("Gather", [b.weight("embed_tokens.weight", [config.vocab, h]), "input_ids"])
    for layer in range(config.layers):
        p = f"layers.{layer}"
        n1 = b.rms_norm(x, f"{p}.input_layernorm", h, rng)
        qkv = [b.op("MatMul", [n1, b.weight(f"{p}.self_attn.{w}.weight", [h, h])]) for w in "qkv"]
        mixed = b.op("Add", [b.op("Add", qkv[:2]), qkv[2]])  # attention's shape, not its math
        x = b.op("Add", [x, b.op("MatMul", [mixed, b.weight(f"{p}.self_attn.o.weight", [h, h])])])
        n2 = b.rms_norm(x, f"{p}.post_attention_layernorm", h, rng)
        gate = b.op("MatMul", [n2, b.weight(f"{p}.mlp.gate.weight", [h, m])])
        up = b.op("MatMul", [n2, b.weight(f"{p}.mlp.up.weight", [h, m])])
        act = b.op("Mul", [b.op("Mul", [gate, b.op("Sigmoid", [gate])]), up])
        x = b.op("Add", [x, b.op("MatMul", [act, b.weight(f"{p}.mlp.down.weight", [m, h])])])
    logits = b.op("MatMul", [b.rms_norm(x, "norm", h, rng), b.weight("lm_head.weight", [h, config.vocab])])
    graph = oh.make_graph(b.nodes, config.name,
                          [oh.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])],
                          [oh.make_tensor_value_info(logits, TensorProto.FLOAT16, ["batch", "seq", config.vocab])],
                          b.inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)])
    model.ir_version = 8
    b.finish()
    path.write_bytes(model.SerializeToString())
    return path, b.offset


def run_lnfuse(args: list[str]) -> tuple[float, float, str]:
    """(seconds, peak RSS in MB, stdout) of one lnfuse run in a child process (wait4 gives its own rusage)."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "lnfuse.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    out = proc.stdout.read().decode()
    err = proc.stderr.read().decode()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"lnfuse failed: {err.strip()}")
    return seconds, usage.ru_maxrss / 1024, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="/tmp/lnfuse-bench", help="where the models are generated")
    parser.add_argument("--configs", default="7b,2.8gb", help=f"comma-separated: {', '.join(CONFIGS)}")
    parser.add_argument("--repeat", type=int, default=2, help="runs per model (the best is reported)")
    args = parser.parse_args()
    rows = []
    for key in args.configs.split(","):
        config = CONFIGS[key]
        t0 = time.perf_counter()
        path, size = generate(config, Path(args.out))
        generated = time.perf_counter() - t0
        out = path.with_name(path.stem + ".fused.onnx")
        best = None
        for _ in range(args.repeat):
            seconds, rss, stdout = run_lnfuse([str(path), "-o", str(out), "--json"])
            if best is None or seconds < best[0]:
                best = (seconds, rss, stdout)
        seconds, rss, stdout = best
        report = json.loads(stdout)
        counts = ", ".join(f"{op} {n}" for op, n in report["fused_counts"].items())
        rows.append((config.name, config.layers, size / 1e9, generated, seconds, rss, counts))
    print(f"{'model':<18} {'layers':>6} {'data GB':>8} {'gen s':>6} {'fuse s':>7} {'peak RSS MB':>12}  fused")
    for name, layers, gb, gen, seconds, rss, counts in rows:
        print(f"{name:<18} {layers:>6} {gb:>8.2f} {gen:>6.1f} {seconds:>7.1f} {rss:>12.0f}  {counts}")


if __name__ == "__main__":
    main()
