"""fp16 models whose norms keep their statistics in float32, made by the fp16 converters users run on float exports.

Converting a float model to float16 with the statistics ops blocked is the usual way to keep its norms accurate:
``convert_float_to_float16(model, op_block_list=["ReduceMean", "Pow", "Sqrt", "Reciprocal"])``. The converters then
write a Cast to float32 in front of each blocked op and a Cast back to float16 after it, so each norm reads
``Cast16(ReduceMean(Cast32(x)))`` and ``Cast16(Sqrt(Cast32(var + eps)))``. Each file here is one existing float
sample converted one way:

* ``*_ort_ops``    ONNX Runtime's converter (``onnxruntime.transformers.float16``) with that ``op_block_list``;
* ``*_ort_nodes``  the same converter with a ``node_block_list`` naming each norm's statistics nodes (the
                   ReduceMeans, the Pow they average, var + eps and its Sqrt), so var + eps is in float32 too;
* ``*_occ_ops``    onnxconverter-common's ``float16.convert_float_to_float16`` with the ``op_block_list``;
* ``*_keepio``     ``keep_io_types=True``: float32 graph inputs and outputs, Casts at the graph's edges;
* ``bert_tiny_dynamo_op18_ort_bf16_stats``  ONNX Runtime's converter with
                   ``use_bfloat16_as_blocked_nodes_dtype=True``: the statistics in bfloat16, which holds fewer digits
                   than float16 (a near-miss: lnfuse must not fuse it; ONNX Runtime's CPU provider cannot run it).

The sources are the float samples next to this folder (torch exports of tiny BERT, GPT-2 and LLaMA, legacy at
opset 14 and dynamo at opset 18, ConvNeXt and SAM's neck with channels-first norms). onnxconverter-common is used on
the three it converts into a model that runs: on the BERT exports and the legacy LLaMA it leaves a Cast to float32
whose output it retypes float16, which neither ONNX Runtime nor the checker accepts. Regenerate with::

    pip install onnxconverter-common==1.16.0    # onnxruntime 1.32.0 and onnx 1.23.2, as lnfuse itself
    python sample_models/make_mixed_precision.py

onnxconverter-common is needed only here, not by lnfuse.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from onnxconverter_common import float16 as occ_float16
from onnxruntime.transformers import float16 as ort_float16

HERE = Path(__file__).resolve().parent
OUT = HERE / "mixed_precision"
#: the ops the converters' users block to keep a norm's statistics in float32
STATISTICS = ["ReduceMean", "Pow", "Sqrt", "Reciprocal"]

#: output name -> (source sample, converter, keep_io_types)
MODELS = {
    "bert_tiny_legacy_op14_ort_ops_keepio": ("bert_tiny_legacy_op14", "ort_ops", True),
    "bert_tiny_dynamo_op18_ort_ops": ("bert_tiny_dynamo_op18", "ort_ops", False),
    "bert_tiny_dynamo_op18_ort_nodes": ("bert_tiny_dynamo_op18", "ort_nodes", False),
    "gpt2_tiny_legacy_op14_occ_ops_keepio": ("gpt2_tiny_legacy_op14", "occ_ops", True),
    "convnext_tiny_legacy_op14_occ_ops": ("convnext_tiny_legacy_op14", "occ_ops", False),
    "llama_tiny_legacy_op14_ort_ops": ("llama_tiny_legacy_op14", "ort_ops", False),
    "llama_tiny_dynamo_op18_ort_ops_keepio": ("llama_tiny_dynamo_op18", "ort_ops", True),
    "llama_tiny_legacy_op14_ort_nodes_keepio": ("llama_tiny_legacy_op14", "ort_nodes", True),
    "llama_tiny_dynamo_op18_occ_ops_keepio": ("llama_tiny_dynamo_op18", "occ_ops", True),
    "sam_neck_legacy_op14_ort_ops": ("sam_neck_legacy_op14", "ort_ops", False),
    "bert_tiny_dynamo_op18_ort_bf16_stats": ("bert_tiny_dynamo_op18", "ort_bf16", False),
}


def statistics_nodes(model: onnx.ModelProto) -> list[str]:
    """Each norm's statistics nodes, as a user names them in ``node_block_list``: every ReduceMean, the Pow it
    averages, the Add of epsilon to what it computes, and the Sqrt of that sum."""
    graph = model.graph
    producer = {out: node for node in graph.node for out in node.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    names = []
    for node in graph.node:
        if node.op_type != "ReduceMean":
            continue
        names.append(node.name)
        source = producer.get(node.input[0])
        if source is not None and source.op_type == "Pow":
            names.append(source.name)
            for add in readers.get(node.output[0], []):
                if add.op_type == "Add":
                    names.append(add.name)
                    names += [n.name for n in readers.get(add.output[0], []) if n.op_type == "Sqrt"]
    return names


def convert(model: onnx.ModelProto, how: str, keep_io: bool) -> onnx.ModelProto:
    if how == "ort_ops":
        return ort_float16.convert_float_to_float16(model, keep_io_types=keep_io, op_block_list=STATISTICS)
    if how == "ort_nodes":
        return ort_float16.convert_float_to_float16(model, keep_io_types=keep_io, op_block_list=[],
                                                    node_block_list=statistics_nodes(model))
    if how == "ort_bf16":
        return ort_float16.convert_float_to_float16(model, keep_io_types=keep_io, op_block_list=STATISTICS,
                                                    use_bfloat16_as_blocked_nodes_dtype=True)
    if how == "occ_ops":
        return occ_float16.convert_float_to_float16(model, keep_io_types=keep_io, op_block_list=STATISTICS)
    raise ValueError(how)


def checkable_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model as the checker takes it: its nodes in an order where each follows what it reads (ONNX Runtime's
    converter appends the Casts it writes at the end of the graph), without the graph's value_info (the converter
    leaves the float16 type on an initializer it keeps in float32 for a blocked op). ONNX Runtime runs the model as
    written; lnfuse reads graphs in any order and takes value_info as a hint, as ONNX Runtime does."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    del copy.graph.value_info[:]
    known = {v.name for v in list(model.graph.input) + list(model.graph.initializer)} | {""}
    pending, ordered = list(model.graph.node), []
    while pending:
        ready = [n for n in pending if all(i in known for i in n.input)]
        if not ready:
            raise ValueError("the graph has a cycle or reads an undefined value")
        for node in ready:
            known.update(node.output)
        ordered += ready
        pending = [n for n in pending if n not in ready]
    del copy.graph.node[:]
    copy.graph.node.extend(ordered)
    return copy


def save_checked(model: onnx.ModelProto, path: Path) -> None:
    """Save the converter's model as it wrote it, after the full check of ``checkable_copy(model)``, at an IR
    version older ONNX Runtime releases read too."""
    model.ir_version = min(model.ir_version, 10)
    onnx.checker.check_model(checkable_copy(model), full_check=True)
    onnx.save(model, path)
    print(f"wrote {path.relative_to(HERE)} ({path.stat().st_size // 1024} KB)")


def main() -> None:
    OUT.mkdir(exist_ok=True)
    for name, (source, how, keep_io) in MODELS.items():
        model = onnx.load(HERE / f"{source}.onnx")
        save_checked(convert(model, how, keep_io), OUT / f"{name}.onnx")


if __name__ == "__main__":
    main()
