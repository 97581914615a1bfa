"""What a fused model may contain: ``ort`` (the default) may write ONNX Runtime's own fused ops, ``onnx`` only
standard ONNX ops. A module of its own so the command line can offer the choice without importing the optimizer."""

TARGETS = ("ort", "onnx")
