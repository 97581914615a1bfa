"""The Python API: ``fuse`` a model (a path or an ``onnx.ModelProto``) and get the fused model and a report."""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import numpy as np
import onnx
import onnx_ir as ir

from lnfuse.load import io
from lnfuse.engine import Options, fuse_model
from lnfuse.index.scopes import count_ops, nodes_of, op_counts
from lnfuse.index.new_values import type_new_values
from lnfuse.save import write
from lnfuse.save.provenance import mark_model
from lnfuse.errors import InputError, UsageError
from lnfuse.report import Report
from lnfuse.match.rule import Rule
from lnfuse.rules import all_rules
from lnfuse.commands.quantize import SCHEMES, accuracy, quantize_embeddings
from lnfuse.targets import TARGETS, rule_names
from lnfuse.match.quantized_norms import quantized_norms
from lnfuse.index.ops import only_ort_runs, op_key, op_name
from lnfuse.index.traversal import every_node
from lnfuse.verification.whole_model import compare_models

if TYPE_CHECKING:  # only for the annotation: lnfuse never imports torch
    from torch.onnx import ONNXProgram


@dataclass
class FuseResult:
    """The fused model (``model`` as an ``onnx.ModelProto``, ``ir_model`` as onnx_ir) and what was done."""

    ir_model: ir.Model
    report: Report
    has_external_data: bool = False
    source_path: Path | None = None
    source_weights: io.SourceWeights | None = None

    @property
    def model(self) -> onnx.ModelProto:
        return ir.serde.serialize_model(self.ir_model)

    def save(self, path: str | os.PathLike, *, in_place: bool = False, external_data: str = "keep",
             report: str | os.PathLike | None = None) -> list[Path]:
        """Write atomically; returns the files written. External weights stay external: ``"keep"`` references the
        input's data files when ``path`` is in the model's folder, and elsewhere copies the parts of them the model
        reads into ``<path>.data``; ``"single"`` writes every weight into ``<path>.data``. No file is ever named by
        the model. ``report``: also write the report as JSON there, renamed into place with the model or not at all."""
        if external_data not in write.EXTERNAL_LAYOUTS:
            raise UsageError(f"unknown external data layout '{external_data}'; use "
                             f"{' or '.join(write.EXTERNAL_LAYOUTS)}")
        return write.save(self.ir_model, path, external_data=external_data if self.has_external_data else None,
                          input_path=self.source_path, in_place=in_place, source=self.source_weights,
                          report=(report, self.report.to_json()) if report is not None else None)


def select_rules(only: Iterable[str] | str | None = None, skip: Iterable[str] | str | None = None
                 ) -> tuple[Rule, ...]:
    """The rules to run: ``only`` these, none of ``skip`` (rule names; one name, or names joined by commas, as a
    string)."""
    only, skip = rule_names(only), rule_names(skip)
    rules = all_rules()
    known = {r.name for r in rules}
    for name in list(only or []) + list(skip or []):
        if name not in known:
            raise UsageError(f"unknown rule '{name}'; known rules: {', '.join(sorted(known))}")
    if only:
        rules = tuple(r for r in rules if r.name in set(only))
    return tuple(r for r in rules if r.name not in set(skip or []))


def fuse(model: str | os.PathLike | onnx.ModelProto | ir.Model | ONNXProgram, *, target: str = "ort",
         verify: bool = True, only: Iterable[str] | None = None, skip: Iterable[str] | None = None,
         upgrade_opset: bool = False, verify_model: bool = False, inputs: dict[str, np.ndarray] | None = None,
         quantize_embeddings: str | None = None, allow_requantization: bool = False,
         progress: Callable[[float, str], None] | None = None) -> FuseResult:
    """Fuse normalization subgraphs into single ops; every rewrite is verified in ONNX Runtime unless
    ``verify=False``. The input (a path, an ``onnx.ModelProto``, an ``onnx_ir.Model`` or torch's ``ONNXProgram``) is
    never modified.

    Example, right after exporting::

        torch.onnx.export(model, args, "model.onnx", opset_version=17)
        result = lnfuse.fuse("model.onnx")
        print(result.report.summary())
        result.save("model.fused.onnx")

    ``target="onnx"`` writes only standard ONNX ops; ``upgrade_opset=True`` then converts an older model to the
    opset the fused ops need, kept only if the whole upgraded model still computes the same outputs.
    ``verify_model=True`` also runs the whole original and fused models (on ``inputs`` or random data).
    ``quantize_embeddings="uint8"|"int8"`` then turns the fused EmbedLayerNormalization nodes into
    QEmbedLayerNormalization and reports the worst difference to the float model.
    ``allow_requantization=True`` keeps rewrites whose outputs reach a quantizer by any path in the graph (refused by
    default: the fused op's rounding moves quantized values by whole steps for some inputs).
    ``progress(fraction, label)`` is called as the work goes on (the CLI draws a bar on a terminal with it).
    """
    if target not in TARGETS:
        raise UsageError(f"unknown target '{target}'; use one of {', '.join(TARGETS)}")
    if quantize_embeddings is not None and (quantize_embeddings not in SCHEMES or target != "ort"):
        raise UsageError(f"--quantize-embeddings takes {' or '.join(SCHEMES)} and needs --target ort")
    model = _unwrapped(model)
    start = time.perf_counter()
    stage = _Stages(progress)
    options = Options(target=target, verify=verify, rules=select_rules(only, skip),
                      allow_requantization=allow_requantization, quantize_embeddings=quantize_embeddings,
                      progress=stage.part(0.1, 0.85) if progress else None)
    stage(0.0, "reading and checking the model")
    with _cycle_collection_paused():
        loaded = io.load(model, defer_symbolic=True)
        source = str(loaded.path) if loaded.path is not None else "<model>"
        original = ir.serde.serialize_model(loaded.model) if (verify_model or upgrade_opset) else None
        report = _run(loaded, options, source)
        if upgrade_opset and target == "onnx" and any(u.check == "opset" for u in report.unfused):
            loaded, report = _upgraded(loaded, options, source, report, original, inputs)
        if quantize_embeddings:
            _quantize(loaded, report, quantize_embeddings)
        if verify_model:
            stage(0.85, "running the whole original and fused models")
            report.model_check = compare_models(original, ir.serde.serialize_model(loaded.model), inputs,
                                                gate=loaded.gate)
        if target == "onnx":
            _standard_ops_only(loaded.model)
        write.strip_inferred_value_info(loaded.model, loaded.declared_value_info, loaded.claims)
        mark_model(loaded.model, report, {"target": target, "verify": verify,
                                          "only": sorted(rule_names(only) or []),
                                          "skip": sorted(rule_names(skip) or []), "upgrade_opset": upgrade_opset,
                                          "verify_model": verify_model, "quantize_embeddings": quantize_embeddings,
                                          "allow_requantization": allow_requantization})
    report.seconds = time.perf_counter() - start
    stage(1.0, "")
    return FuseResult(loaded.model, report, loaded.has_external_data, loaded.path, loaded.source)


def _unwrapped(model):
    """torch.onnx.export(..., dynamo=True) returns an ``ONNXProgram`` whose ``model`` is an ``onnx_ir.Model``: take
    that (by its attribute, so that lnfuse never imports torch)."""
    inner = getattr(model, "model", None)
    if not isinstance(model, (str, os.PathLike, onnx.ModelProto, ir.Model)) and isinstance(inner, ir.Model):
        return inner
    return model


@contextlib.contextmanager
def _cycle_collection_paused() -> Iterator[None]:
    """lnfuse makes and drops many small linked objects (graph nodes, matches, protos). Each time Python's cycle
    collector triggers, it walks every live object of the process: in an export script that holds a framework, far
    more than lnfuse's own. It is paused while lnfuse works; what lnfuse dropped is collected on the next pass."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _Stages:
    """Maps the engine's progress (0..1 over its passes) into the whole run's, for the caller's callback."""

    def __init__(self, progress: Callable[[float, str], None] | None):
        self.progress = progress

    def __call__(self, fraction: float, label: str) -> None:
        if self.progress is not None:
            self.progress(fraction, label)

    def part(self, start: float, end: float) -> Callable[[float, str], None]:
        return lambda fraction, label: self(start + (end - start) * fraction, label)


def _run(loaded: io.Loaded, options: Options, source: str) -> Report:
    report = Report(source=source, target=options.target, verified=options.verify)
    before = nodes_of(loaded.model)
    report.ops_before = count_ops(before)
    if loaded.shape_inference_error:
        report.notes.append(f"shape inference failed ({loaded.shape_inference_error}); checks that need shapes "
                            "refuse where shapes are unknown")
    fuse_model(loaded.model, options, report, before, shapes=loaded.pending_shapes)
    loaded.pending_shapes = None
    loaded.declared_value_info |= type_new_values(loaded.model, before)
    report.unfused.extend(quantized_norms(loaded.model, report))
    after = _ops_by_graph(loaded.model)  # one walk for both (a walk of a million nodes costs)
    report.ops_after = _count_ops_by_type(after)
    _note_runtime_ops(loaded.model, report, after)
    opset_refusals = [u for u in report.unfused if u.check == "opset"]
    if opset_refusals:
        report.notes.append(f"{len(opset_refusals)} candidate(s) need a newer opset: rerun with --upgrade-opset "
                            "(or --target ort)")
    return report


def _upgraded(loaded: io.Loaded, options: Options, source: str, report: Report, original: onnx.ModelProto,
              inputs) -> tuple[io.Loaded, Report]:
    """Convert to the opset the refused ops need; keep the result only if the whole model still agrees."""
    needed = 23 if any(u.rule == "rms_norm" and u.check == "opset" for u in report.unfused) else 17
    try:
        converted = onnx.version_converter.convert_version(original, needed)
        # the input's data, admitted again by a gate at the input's folder
        upgraded = io.load(converted, base_dir=loaded.gate.folder, defer_symbolic=True)
    except Exception as error:  # noqa: BLE001 - the converter raises many types; the report says why
        report.notes.append(f"--upgrade-opset: onnx's version converter could not reach opset {needed} "
                            f"({str(error).splitlines()[0][:200]}); the model keeps its opset")
        return loaded, report
    upgraded.declared_value_info, upgraded.claims = loaded.declared_value_info, loaded.claims
    # every file the input read (the model, data files of tensors read inline at load): none may be overwritten
    upgraded.model.meta[io.INPUT_FILES] = loaded.model.meta.get(io.INPUT_FILES, [])
    upgraded.model.meta[io.DATA_LOCATIONS] = loaded.model.meta.get(io.DATA_LOCATIONS, {})
    # the converted model is the same file's graph: its external data stays beside the input, wherever we run from
    upgraded.path, upgraded.source, upgraded.has_external_data = loaded.path, loaded.source, loaded.has_external_data
    upgraded_report = _run(upgraded, options, source)
    try:
        check = compare_models(original, ir.serde.serialize_model(upgraded.model), inputs,
                               gate=upgraded.gate, option="--upgrade-opset")
    except InputError as error:
        # the upgrade is kept only if the whole model is proven to agree; unproven, the model keeps its opset
        report.notes.append(f"kept opset {loaded.model.opset_imports.get('')}: {error}")
        return loaded, report
    if not check["ok"]:
        report.notes.append(f"--upgrade-opset: the model upgraded to opset {needed} no longer agrees with the "
                            f"original ({check['summary']}); kept the original opset")
        return loaded, report
    upgraded_report.notes.append(f"upgraded from opset {loaded.model.opset_imports.get('')} to {needed} with "
                                 f"onnx's version converter; whole model verified ({check['summary']})")
    return upgraded, upgraded_report


def _quantize(loaded: io.Loaded, report: Report, scheme: str) -> None:
    float_model = ir.serde.serialize_model(loaded.model)
    names = {v.name for n in loaded.model.graph for v in n.outputs} | set(loaded.model.graph.initializers)
    before = nodes_of(loaded.model)
    count = quantize_embeddings(loaded.model, scheme, names, report)
    loaded.declared_value_info |= type_new_values(loaded.model, before)
    if count:
        check = accuracy(float_model, ir.serde.serialize_model(loaded.model))
        report.notes.append(f"quantized {count} embedding block(s) to {scheme}; against the float model on random "
                            f"valid ids: worst output difference {max(check['outputs'].values()):.3g}")
        report.ops_after = op_counts(loaded.model)


def _note_runtime_ops(model: ir.Model, report: Report,
                      ops: dict[ir.Graph | ir.Function, Counter[tuple[str, str]]]) -> None:
    """Say which ops only ONNX Runtime runs: its contrib ops (onnx.checker accepts other domains) and its own ops
    in the default domain where ONNX has none at the model's opset (onnx.checker rejects those). ``ops``: the
    model's, from ``_ops_by_graph``."""
    opset = model.opset_imports.get("", 1)
    contrib, default = set(), set()
    for graph, counts in ops.items():
        graph_opset = graph.opset_imports.get("", opset) if isinstance(graph, ir.Function) else opset
        for domain, op_type in counts:
            if only_ort_runs(domain, op_type, graph_opset):
                (default if domain in ("", "ai.onnx") else contrib).add(op_type)
    report.ort_only = bool(contrib or default)
    if default:
        report.notes.append(f"the output uses ONNX Runtime's own {', '.join(sorted(default))} in the default "
                            f"domain (ONNX has none at opset {opset}): onnx.checker rejects it, ONNX Runtime runs "
                            "it; use --target onnx for standard ops only")
    elif contrib:
        report.notes.append(f"the output uses ONNX Runtime's com.microsoft ops ({', '.join(sorted(contrib))}): "
                            "only ONNX Runtime runs it; use --target onnx for standard ops only")


def _ops_by_graph(model: ir.Model) -> dict[ir.Graph | ir.Function, Counter[tuple[str, str]]]:
    """For the main graph (with its subgraphs) and each function: how many nodes of each (domain, op type), in the
    order they first appear."""
    return {graph: Counter((node.domain, node.op_type) for node in every_node(graph))
            for graph in [model.graph, *model.functions.values()]}


def _count_ops_by_type(ops: dict[ir.Graph | ir.Function, Counter[tuple[str, str]]]) -> dict[str, int]:
    """``scopes.op_counts`` from ``_ops_by_graph``: each op type in the order it first appears."""
    counts: Counter[str] = Counter()
    for graph_counts in ops.values():
        for (_, op_type), count in graph_counts.items():
            counts[op_type] += count
    return dict(counts)



#: ONNX Runtime's ops that ``lnfuse decompose`` lowers to ONNX ops
_LOWERED = frozenset({"LayerNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
                      "SkipSimplifiedLayerNormalization", "EmbedLayerNormalization", "RMSNormalization"})


def _standard_ops_only(model: ir.Model) -> None:
    """``--target onnx`` keeps its promise on every input: a model still holding an op only ONNX Runtime runs (one
    the input brought: a contrib op, or a default-domain op ONNX does not define at the model's opset, such as
    ORT's LayerNormalization before opset 17) is refused, never written to fail the checker."""
    graphs = [(model.graph, model.opset_imports.get("", 1))]
    graphs += [(f, f.opset_imports.get("", model.opset_imports.get("", 1))) for f in model.functions.values()]
    for graph, opset in graphs:
        for node in every_node(graph):
            domain, name = op_key(node)
            if only_ort_runs(domain, name, opset):
                fix = "run lnfuse decompose on it first" if name in _LOWERED else "use --target ort (the default)"
                raise UsageError(f"--target onnx: the model holds {op_name(node)} '{node.name}', which only ONNX "
                                 f"Runtime runs{'' if domain else f' at opset {opset}'}; {fix}")
