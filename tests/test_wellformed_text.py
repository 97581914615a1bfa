"""The well-formedness check refuses exactly the text that is not UTF-8, wherever it is, whether it is found by
protobuf's own check of all strings at once or by the field-by-field walk that names it."""

import random

import onnx
import onnx.helper as oh
import pytest

from lnfuse.load import wellformed
from lnfuse.errors import InputError


def _model(name: bytes) -> onnx.ModelProto:
    """A model whose second node is named ``name`` (protobuf keeps bytes that are not UTF-8 as they are)."""
    graph = oh.make_graph([oh.make_node("Neg", ["x"], ["a"])], "g",
                          [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
                          [oh.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [2])])
    named = oh.make_node("Neg", ["a"], ["y"], name="plain").SerializeToString()
    graph.node.add().MergeFromString(named.replace(b"\x1a\x05plain", b"\x1a" + bytes([len(name)]) + name))
    graph.node.append(oh.make_node("Cast", ["y"], ["z"], to=onnx.TensorProto.FLOAT))
    return oh.make_model(graph)


def _samples() -> list[bytes]:
    rng = random.Random(0)
    made = [b"pl\xc3\xa9n", b"pl\xffin", b"\xed\xa0\x80ab", b"\xc0\xafabc", b"\xf4\x90\x80\x80a", b"ab\xe2\x82"]
    while len(made) < 200:
        made.append(bytes(rng.choice([0x41, 0x80, 0xbf, 0xc2, 0xe0, 0xed, 0xf0, 0xf4, 0xff, rng.randrange(256)])
                          for _ in range(5)))
    return made


@pytest.mark.parametrize("name", _samples())
def test_text_refused_iff_not_utf8(name: bytes) -> None:
    proto = _model(name)
    assert proto.graph.node[1].name in (name, name.decode("utf-8", "replace"))  # the node holds the bytes
    try:
        name.decode("utf-8")
        valid = True
    except UnicodeDecodeError:
        valid = False
    assert wellformed._all_text_is_utf8(proto) is valid
    if valid:
        wellformed.check(proto, "m")
    else:
        with pytest.raises(InputError, match="not UTF-8"):
            wellformed.check(proto, "m")
