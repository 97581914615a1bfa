"""Load: the one gate every byte of a model folder comes through, checks of what protobuf accepts but later steps
assume, the repairs ONNX Runtime makes itself, and weights left in their file until a rule needs them."""
