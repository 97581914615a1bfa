"""lnfuse inside other tools' pipelines: an ``onnx_ir`` pass and a Microsoft Olive pass."""
