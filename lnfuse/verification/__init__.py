"""Verification: running a matched region and its replacement in ONNX Runtime on the same inputs, and whole models
before and after."""
