"""Sweep: export tiny random models with both torch exporters, in several dtypes and opsets, fuse each with lnfuse,
and tabulate model × exporter × dtype → norms in the model, norm ops after fusing, means left, and why.

Not part of the test suite (exports take minutes). Run from the repo root:

    python tests/sweep/run_sweep.py --out /tmp/sweep/results.jsonl            # everything (about 30 min)
    python tests/sweep/run_sweep.py --only 'gemma|user_' --dtypes fp32,fp16     # a subset
    python tests/sweep/run_sweep.py --table /tmp/sweep/results.jsonl           # the markdown table again
    python tests/sweep/run_sweep.py --samples sample_models/sweep               # the exports the tests read

Each row is appended to the JSONL file as it is done, and rows already there are skipped, so a run can be resumed.
``--save DIR`` keeps each export (``DIR/<model>_<exporter>_op<N>_<dtype>.onnx``) for ``lnfuse explain``.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import re
import sys
import time
import traceback
import warnings
from pathlib import Path

import onnx
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import models  # noqa: E402

import lnfuse  # noqa: E402

logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)

NORM_OPS = ("LayerNormalization", "SimplifiedLayerNormalization", "RMSNormalization", "SkipLayerNormalization",
            "SkipSimplifiedLayerNormalization", "EmbedLayerNormalization")
MEANS = ("ReduceMean", "GlobalAveragePool")
OTHER_NORMS = ("InstanceNormalization", "BatchNormalization", "GroupNormalization", "LpNormalization")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# (exporter, opset); opset 23 only for the LLM-like cases (RMSNormalization)
EXPORTS = [("legacy", 14), ("legacy", 17), ("dynamo", 18), ("dynamo", 23)]
TEXT_INPUTS = ("input_ids", "attention_mask", "decoder_input_ids")
# the exports tests/test_sweep_spellings.py reads (sample_models/sweep/, written by --samples)
SAMPLES = [("user_ln_var_unbiased_false", "dynamo", 18), ("user_ln_var_mean", "dynamo", 18),
           ("user_ln_hand_fp32", "dynamo", 23),
           # float16: torch keeps these statistics in float32 and rounds them back (tests/test_mixed_precision.py)
           ("user_ln_var_unbiased_false", "dynamo", 18, "fp16"), ("user_ln_var_mean", "dynamo", 18, "fp16")]


def is_norm_module(module: nn.Module) -> bool:
    name = type(module).__name__
    if isinstance(module, (nn.GroupNorm, nn.modules.batchnorm._NormBase)) or next(module.children(), None) is not None:
        return False  # not a norm, or a container named like one (Wav2Vec2EncoderStableLayerNorm)
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or name.endswith(("LayerNorm", "RMSNorm", "RMSNormGated"))


def count_norm_calls(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> int:
    """How many times a norm module runs in one forward (shared modules count once per call; nested ones once)."""
    calls = [0]
    depth = [0]

    def pre(_m, _a):
        if depth[0] == 0:
            calls[0] += 1
        depth[0] += 1

    def post(_m, _a, _o):
        depth[0] -= 1

    handles = []
    for m in module.modules():
        if is_norm_module(m):
            handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    try:
        with torch.no_grad():
            module(*inputs)
    finally:
        for h in handles:
            h.remove()
    return calls[0]


def randomize_norms(module: nn.Module) -> None:
    """Norm weights off 1 (or off 0 for the (1 + w) norms) and biases off 0, so a wrong fusion shows."""
    with torch.no_grad():
        for m in module.modules():
            if not is_norm_module(m):
                continue
            weight = getattr(m, "weight", None)
            if isinstance(weight, torch.Tensor):
                weight.add_(torch.randn_like(weight) * 0.2)
            bias = getattr(m, "bias", None)
            if isinstance(bias, torch.Tensor):
                bias.add_(torch.randn_like(bias) * 0.2)


def dynamic_dims(case: models.Case) -> dict[str, dict[int, str]]:
    dims = {}
    for name in case.names:
        dims[name] = {0: "batch"}
        if name in TEXT_INPUTS:
            dims[name][1] = "sequence"
    return dims


def export(case: models.Case, exporter: str, opset: int) -> onnx.ModelProto:
    dims = dynamic_dims(case)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            buffer = io.BytesIO()
            torch.onnx.export(case.module, case.inputs, buffer, dynamo=False, opset_version=opset,
                              input_names=list(case.names), output_names=["y"],
                              dynamic_axes={**dims, "y": {0: "batch"}}, do_constant_folding=True)
            return onnx.load_from_string(buffer.getvalue())
        shapes = tuple({axis: torch.export.Dim.AUTO for axis in dims[n]} for n in case.names)
        # forward(x, ...) takes one spec per argument; the wrappers' forward(*args) one tuple for all
        structure = (shapes,) if isinstance(case.module, models.FirstOutput) else shapes
        try:
            program = torch.onnx.export(case.module, case.inputs, dynamo=True, opset_version=opset,
                                        input_names=list(case.names), output_names=["y"],
                                        dynamic_shapes=structure, verbose=False)
        except Exception:  # noqa: BLE001  (some models specialise a dim: fall back to static shapes)
            program = torch.onnx.export(case.module, case.inputs, dynamo=True, opset_version=opset,
                                        input_names=list(case.names), output_names=["y"], verbose=False)
        return program.model_proto


def _ops(model: onnx.ModelProto) -> list[str]:
    """Op types of the main graph and every function (dynamo keeps some modules as functions at times)."""
    ops = [n.op_type for n in model.graph.node]
    for f in model.functions:
        ops += [n.op_type for n in f.node]
    return ops


def build(name: str, dtype: str) -> models.Case:
    """The case's module (norms moved off identity, eval mode) and inputs, in ``dtype``; its ``norms`` counted."""
    builder, _ = models.cases()[name]
    torch.manual_seed(0)
    case = builder()
    randomize_norms(case.module)
    case.module.eval()
    if dtype != "fp32":
        case.module.to(DTYPES[dtype])
        case.inputs = tuple(t.to(DTYPES[dtype]) if t.is_floating_point() else t for t in case.inputs)
    if case.norms is None:
        case.norms = count_norm_calls(case.module, case.inputs)
    return case


def run_one(name: str, dtype: str, exporter: str, opset: int, save: Path | None, reuse: bool = False) -> dict:
    """Export (or, with ``reuse``, read the export saved in ``save``) and fuse one case."""
    row = {"model": name, "exporter": exporter, "opset": opset, "dtype": dtype}
    start = time.perf_counter()
    saved = None if save is None else save / f"{name}_{exporter}_op{opset}_{dtype}.onnx"
    try:
        case = build(name, dtype)
        row["norms"] = case.norms
        loaded = reuse and saved is not None and saved.exists()
        proto = onnx.load(str(saved)) if loaded else export(case, exporter, opset)
    except Exception as error:  # noqa: BLE001
        row["export_error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
        row["seconds"] = round(time.perf_counter() - start, 1)
        return row
    if saved is not None and not loaded:
        onnx.save_model(proto, str(saved))
    row.update(fuse_row(proto, case, dtype))
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def fuse_row(proto: onnx.ModelProto, case: models.Case, dtype: str) -> dict:
    """lnfuse on one export, checked as a whole on the export's own inputs: what it fused, what it left and why."""
    before = _ops(proto)
    row = {"means_before": sum(before.count(op) for op in MEANS),
           "norm_ops_before": sum(before.count(op) for op in NORM_OPS),
           # the dynamo exporter falls back to static shapes where torch.export cannot keep a dim dynamic
           "static_shapes": all(d.HasField("dim_value") for i in proto.graph.input
                                for d in i.type.tensor_type.shape.dim)}
    feeds = None if dtype == "bf16" else {n: t.numpy() for n, t in zip(case.names, case.inputs)}
    try:
        try:
            result = lnfuse.fuse(proto, verify_model=True, inputs=feeds)
        except lnfuse.LnfuseError as error:
            if "original model" not in str(error):
                raise
            # the export itself does not run in ORT (an exporter bug): fuse with region checks only
            row["original_fails_in_ort"] = str(error)[:200]
            result = lnfuse.fuse(proto)
    except Exception as error:  # noqa: BLE001
        row["fuse_error"] = f"{type(error).__name__}: {str(error)[:300]}"
        row["traceback"] = traceback.format_exc()[-1500:]
        return row
    after = _ops(result.model)
    row["norm_ops"] = {op: after.count(op) for op in NORM_OPS if after.count(op)}
    row["fused"] = sum(row["norm_ops"].values())
    row["means_left"] = sum(after.count(op) for op in MEANS)
    row["sums_left"] = after.count("ReduceSum")  # a mean written ReduceSum / N
    row["other_norm_ops"] = {op: after.count(op) for op in OTHER_NORMS if after.count(op)}
    row["unfused"] = sorted({f"{u.rule}/{u.check}: {u.reason[:160]}" for u in result.report.unfused})
    row["notes"] = [n[:200] for n in result.report.notes][:5]
    row["model_check"] = result.report.model_check
    return row


def table(rows: list[dict]) -> str:
    rows = [json.loads(re.sub(r"\\u001b\[\d+m", "", json.dumps(r))) for r in rows]  # torch's colours
    lines = ["| model | exporter | dtype | norms | fused (norm ops after) | means left | left / why |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        exp = f"{r['exporter']} op{r['opset']}" + (" (static)" if r.get("static_shapes") else "")
        if "export_error" in r:
            lines.append(f"| {r['model']} | {exp} | {r['dtype']} | {r.get('norms', '?')} | export failed | | "
                         f"{r['export_error'][:90]} |")
            continue
        if "fuse_error" in r:
            lines.append(f"| {r['model']} | {exp} | {r['dtype']} | {r['norms']} | **lnfuse error** | | "
                         f"{r['fuse_error'][:120]} |")
            continue
        ops = ", ".join(f"{k.replace('Normalization', '')} {v}" for k, v in r["norm_ops"].items()) or "-"
        norm_left = r["means_left"] or r.get("sums_left") or \
            any(u.startswith(("layer_norm/", "rms_norm/")) for u in r["unfused"])
        mark = "" if r["fused"] == r["norms"] else " **extra**" if r["fused"] > r["norms"] else \
            " **miss**" if norm_left else f" ({r['norms'] - r['fused']} shared or dead in the export)"
        why = "; ".join(r["unfused"])[:300]
        check = r.get("model_check") or {}
        if check and not check.get("ok", True):
            why = f"**whole model differs** {check} " + why
        lines.append(f"| {r['model']} | {exp} | {r['dtype']} | {r['norms']} | {r['fused']}{mark} ({ops}) | "
                     f"{r['means_left']} | {why} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/sweep/results.jsonl"))
    parser.add_argument("--only", default=".", help="regex on model names")
    parser.add_argument("--dtypes", default="fp32,fp16,bf16")
    parser.add_argument("--exports", default=",".join(f"{e}{o}" for e, o in EXPORTS),
                        help="comma list of legacy14,legacy17,dynamo18,dynamo23")
    parser.add_argument("--save", type=Path, default=None)
    parser.add_argument("--reuse", action="store_true",
                        help="fuse the exports already in --save instead of exporting again (after a fix)")
    parser.add_argument("--samples", type=Path, default=None,
                        help="write the exports the tests read (SAMPLES) to this folder and exit")
    parser.add_argument("--table", type=Path, default=None, help="print the table of a JSONL file and exit")
    args = parser.parse_args(argv)
    if args.table:
        print(table([json.loads(line) for line in args.table.read_text().splitlines() if line.strip()]))
        return 0
    if args.samples:
        args.samples.mkdir(parents=True, exist_ok=True)
        for name, exporter, opset, *dtype in SAMPLES:
            dtype = dtype[0] if dtype else "fp32"
            proto = export(build(name, dtype), exporter, opset)
            onnx.checker.check_model(proto, full_check=True)
            suffix = "" if dtype == "fp32" else f"_{dtype}"
            onnx.save_model(proto, str(args.samples / f"{name}_{exporter}_op{opset}{suffix}.onnx"))
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.save:
        args.save.mkdir(parents=True, exist_ok=True)
    done = set()
    if args.out.exists():
        for line in args.out.read_text().splitlines():
            r = json.loads(line)
            done.add((r["model"], r["exporter"], r["opset"], r["dtype"]))
    wanted = [tuple(re.fullmatch(r"([a-z]+)(\d+)", e).groups()) for e in args.exports.split(",")]
    for name, (_, llm_like) in models.cases().items():
        if not re.search(args.only, name):
            continue
        for dtype in args.dtypes.split(","):
            if dtype == "bf16" and not llm_like:
                continue  # bf16 only where it is common (LLMs, hand-written norms)
            for exporter, opset in ((e, int(o)) for e, o in wanted):
                if opset == 23 and not llm_like:
                    continue
                if exporter == "legacy" and dtype == "bf16":
                    continue  # the TorchScript exporter has no bf16 path worth sweeping
                if (name, exporter, opset, dtype) in done:
                    continue
                row = run_one(name, dtype, exporter, opset, args.save, args.reuse)
                with args.out.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                print(table([row]).splitlines()[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
