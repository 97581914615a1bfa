"""The one gate every byte of a model folder passes through.

A model names files it wants read: the external-data locations of its tensors, wherever a tensor can be
(initializers, sparse values and indices, Constant and attribute tensors, in the main graph, in If/Loop/Scan bodies
and in model-local functions). ``Gate`` is anchored at the real path of the model's folder and is the only code that
opens such a file. It admits a location once it is inside the folder (links followed), a regular file with one link,
and holding the tensor's bytes where the entry says; every later read opens the admitted file again, without
following links and without blocking, and checks that it is still the file that was admitted.

After ``admit_all`` the model holds external references only in its weights (large initializers and Constant values
of the main graph, read lazily through a ``GatedTensor``); everything else is inline. No library lnfuse calls (onnx, onnx_ir, ONNX Runtime, ORT's symbolic
shape inference) is ever handed a reference it would resolve against the working directory: ORT sessions get the
admitted weights as in-memory values (``ort_initializers``).
"""

from __future__ import annotations

import math
import mmap
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

import numpy as np
import onnx
import onnx_ir as ir

from lnfuse import userkey
from lnfuse.load import trust
from lnfuse.errors import InputError
from lnfuse.index.ops import is_op

#: external bytes lnfuse copies inline at load (everything but the main graph's weights: small constants, sparse
#: parts, tensors in bodies and functions). These are small in real models (a Reshape target, an epsilon); the cap
#: keeps a model from making lnfuse hold a multi-gigabyte data file in memory through them.
MAX_INLINED_BYTES = 512 << 20

#: a main-graph Constant value with more elements than this is a weight: its values never decide a shape, so it stays
#: on disk (read through the gate when a rule needs it). Smaller ones are read at load.
WEIGHT_ELEMENTS = 1024


@dataclass(frozen=True)
class _File:
    """An admitted data file: its real path, identity (device, inode) and size when it was admitted, and its stat
    key then (inode, size, mtime_ns, ctime_ns: what a many-model run's ledger compares)."""

    real: str
    identity: tuple[int, int]
    size: int
    key: tuple[int, int, int, int]


class Gate:
    """The reader of one model folder's data files (see the module's docstring)."""

    def __init__(self, folder: str | os.PathLike, where: str) -> None:
        self.folder = Path(os.path.realpath(folder))
        self.where = where
        self._files: dict[str, _File] = {}
        self._inlined = 0

    # -- admission ------------------------------------------------------------------------------------------------

    def admit_all(self, proto: onnx.ModelProto, lnfuse_made: Callable[[onnx.TensorProto], bool] | None = None,
                  read_inline: bool = True) -> None:
        """Admit every external tensor of ``proto`` and copy inline all but the weights (``every_tensor``), so that
        no library lnfuse hands the model to reads a file itself. ``lnfuse_made`` tells the placeholders lnfuse put
        in for weights left in the model file (the file the user named, read by ``weights``): only a weight's slot
        can hold one, so a tensor elsewhere that looks like one is external data like any other. ``read_inline``
        False only lists the files (``files``), reading nothing."""
        for tensor, weight in every_tensor(proto):
            if tensor.data_location != onnx.TensorProto.EXTERNAL or \
                    (weight and lnfuse_made is not None and lnfuse_made(tensor)):
                continue
            offset, length = self.admit(tensor)
            if read_inline and not weight:
                self._inline(tensor, offset, length)

    def admit(self, tensor: onnx.TensorProto) -> tuple[int, int]:
        """(offset, length) of a tensor's bytes in its admitted file, or ``InputError`` naming the tensor."""
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        if not isinstance(location, str):  # protobuf hands back text that is not UTF-8 as bytes
            raise InputError(f"{self.where}: tensor {_name(tensor)!r} has an external-data location that is not "
                             f"UTF-8 text ({location[:40]!r}); re-export the model")
        said = f"{self.where}: tensor {_name(tensor)!r} has external data {location!r}"
        file = self._file(location, said)
        offset = _number(info.get("offset", "0"), said, "offset")
        needed = _tensor_bytes(tensor, said)
        length = _number(info["length"], said, "length") if "length" in info else file.size - offset
        if length != needed:
            raise InputError(f"{said}: its length {length} is not the {needed} bytes its type and shape need; "
                             "re-export the model")
        if offset + length > file.size:
            raise InputError(f"{said}: bytes {offset}..{offset + length} lie past the end of the {file.size}-byte "
                             "file; the file is truncated or not this model's")
        return offset, length

    def admit_file(self, location: str) -> None:
        """Admit a data file by its location alone, with the same checks as a tensor's (inside the folder, links
        followed; a regular file of one link), so that ``open`` may read it: for readers of whole files, such as
        the content hash a many-model run records for resuming."""
        self._file(location, f"{self.where}: data file {location!r}")

    def _file(self, location: str, said: str) -> _File:
        if location in self._files:
            return self._files[location]
        if not location or "\0" in location:
            raise InputError(f"{said}: not a file name; re-export the model")
        if os.path.isabs(location) or location.startswith(("/", "\\")) or ".." in Path(location).parts:
            raise InputError(f"{said} outside the model's folder; external data must be a relative path inside it "
                             "(onnx and ONNX Runtime refuse it too)")
        real = os.path.realpath(self.folder / location)
        if not trust.inside(real, str(self.folder)):
            raise InputError(f"{said}, a link to {real!r} outside the model's folder; copy the file into the "
                             "folder (cp -L) if you trust it")
        try:
            st = os.stat(os.path.join(self.folder, location))  # as readers join it: "w.data/" is not w.data
        except OSError:
            raise InputError(f"{said}: the file is missing; put it next to the model") from None
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{said}: not a regular file; re-export the model")
        if st.st_nlink > 1:
            # another name for these bytes may live anywhere on the file system (a hard link to a secret is as
            # good as a symbolic one, and cannot be seen through); onnx's checker refuses it as a "hardlink attack"
            raise InputError(f"{said}: the file has {st.st_nlink} hard links; copy it (cp) to a file of its own")
        if userkey.is_key(st):
            raise InputError(f"{said}: that is lnfuse's own key file, never a model's data")
        self._files[location] = _File(real, (st.st_dev, st.st_ino), st.st_size,
                                      (st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        return self._files[location]

    def identity(self, location: str) -> tuple[int, int]:
        """(device, inode) of the admitted file ``location`` names: two locations (a link inside the folder, ``./``)
        may name one file."""
        return self._files[location].identity

    def files(self) -> list[Path]:
        """The data files admitted so far (real paths)."""
        return sorted({Path(f.real) for f in self._files.values()})

    def admitted(self) -> dict[str, list[int]]:
        """The locations admitted so far, as the model names them (a link is named, not what it points at, so
        that pointing it elsewhere is a change), each with its file's stat key when it was admitted."""
        return {location: list(file.key) for location, file in sorted(self._files.items())}

    # -- reading --------------------------------------------------------------------------------------------------

    def open(self, location: str) -> BinaryIO:
        """The admitted file ``location`` names, opened for reading: not through a link (the real path was
        resolved at admission), not blocking on a FIFO put there since, and still the file admitted."""
        file = self._files.get(location)
        if file is None:
            raise RuntimeError(f"{self.where}: {location!r} was not admitted by the gate (a bug in lnfuse)")
        try:
            fd = os.open(file.real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as error:
            raise InputError(f"{self.where}: external data {location!r} cannot be opened any more "
                             f"({error.strerror}); run lnfuse again") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != file.identity or st.st_size < file.size:
            os.close(fd)
            raise InputError(f"{self.where}: external data {location!r} was replaced or shortened after lnfuse "
                             "checked it; run lnfuse again on a folder nothing else is changing")
        return os.fdopen(fd, "rb")

    def read(self, location: str, offset: int, length: int) -> bytes:
        with self.open(location) as file:
            data = os.pread(file.fileno(), length, offset)
            while len(data) < length:  # pread may return less than asked
                more = os.pread(file.fileno(), length - len(data), offset + len(data))
                if not more:
                    raise InputError(f"{self.where}: external data {location!r} got shorter while lnfuse read it")
                data += more
        return data

    def map(self, location: str, offset: int, length: int) -> tuple[mmap.mmap, int]:
        """The ``length`` bytes at ``offset`` of the admitted file, mapped read-only (weights are read without
        copying them into memory), and where they start in the map: only their pages are mapped, never the whole
        file, whose size is no business of the tensor's (a sparse file of 2^62 bytes would not fit the address
        space)."""
        if length == 0:  # an empty tensor: a map of nothing from the file, closable like the others
            return mmap.mmap(-1, 1), 0
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        with self.open(location) as file:
            try:
                return mmap.mmap(file.fileno(), offset - start + length, offset=start, access=mmap.ACCESS_READ), \
                    offset - start
            except (OSError, ValueError) as error:
                raise InputError(f"{self.where}: external data {location!r} cannot be mapped ({error}); run lnfuse "
                                 "again, or with more address space (ulimit -v)") from None

    def inline(self, tensor: onnx.TensorProto) -> onnx.TensorProto:
        """A copy of an admitted external tensor with its bytes inline."""
        small = onnx.TensorProto()
        small.CopyFrom(tensor)
        self._inline(small, *self.admit(tensor))
        return small

    def _inline(self, tensor: onnx.TensorProto, offset: int, length: int) -> None:
        self._inlined += length
        if self._inlined > MAX_INLINED_BYTES:
            raise InputError(f"{self.where}: tensor {_name(tensor)!r}: more than {MAX_INLINED_BYTES >> 20} MiB of "
                             "external data outside the main graph's weights (small Constants, sparse tensors, "
                             "subgraphs, functions); store large weights as initializers of the main graph")
        location = next(e.value for e in tensor.external_data if e.key == "location")
        data = self.read(location, offset, length)
        del tensor.external_data[:]
        tensor.data_location = onnx.TensorProto.DEFAULT
        tensor.raw_data = data

    def array(self, tensor: onnx.TensorProto) -> np.ndarray:
        """The values of an external tensor (a serialized ``GatedTensor``), read through the gate."""
        info = {e.key: e.value for e in tensor.external_data}
        mapped, start = self.map(info["location"], *self.admit(tensor))
        return _decode(mapped, start, ir.DataType(tensor.data_type), tuple(tensor.dims))

    # -- the model's tensors ----------------------------------------------------------------------------------------

    def attach(self, model: ir.Model) -> bool:
        """Make every external tensor left in ``model`` (its weights) read through this gate. Whether there was
        one."""
        found = False
        for value in model.graph.initializers.values():
            if type(value.const_value) is ir.ExternalTensor:
                value.const_value = GatedTensor(self, value.const_value)
                found = True
        for node in model.graph:
            # any node's "value": an external tensor there is gated whatever op holds it
            attribute = node.attributes.get("value")
            if attribute is not None and type(attribute.value) is ir.ExternalTensor:
                node.attributes["value"] = ir.AttrTensor("value", GatedTensor(self, attribute.value),
                                                         doc_string=attribute.doc_string)
                found = True
        return found


class GatedTensor(ir.ExternalTensor):
    """An external weight whose bytes are read through its gate, never by path: onnx_ir would open
    ``base_dir / location`` itself, and a ``base_dir`` that a caller changes (or a relative one, under another
    working directory) would read another file."""

    __slots__ = ("_gate", "_start")

    def __init__(self, gate: Gate, like: ir.ExternalTensor) -> None:
        super().__init__(like.location, like.offset, like.length, like.dtype, shape=like.shape, name=like.name,
                         doc_string=like.doc_string, metadata_props=dict(like.metadata_props) or None,
                         base_dir=gate.folder)
        self._gate, self._start = gate, 0

    @property
    def gate(self) -> Gate:
        return self._gate

    @property
    def base_dir(self) -> Path:
        return self._gate.folder

    @base_dir.setter
    def base_dir(self, value) -> None:
        """Ignored: the gate decides where the bytes are read from (onnx_ir's ``set_base_dir`` calls this)."""

    def _load(self) -> None:
        self.raw, self._start = self._gate.map(str(self.location), self.offset or 0, self.length or self.nbytes)
        self._array = _decode(self.raw, self._start, self.dtype, tuple(self.shape.numpy()))

    def tobytes(self) -> bytes:
        """The tensor's bytes (onnx_ir's would index the map by the file offset: only the tensor's pages are
        mapped)."""
        self._check_validity()
        if self.raw is None:
            self._load()
        return bytes(self.raw[self._start:self._start + (self.length or self.nbytes)])

    def tofile(self, file) -> None:
        offset, length = self.offset or 0, self.length or self.nbytes
        with self._gate.open(str(self.location)) as source:
            while length:
                chunk = os.pread(source.fileno(), min(length, 1 << 24), offset)
                if not chunk:
                    raise InputError(f"{self._gate.where}: external data {str(self.location)!r} got shorter "
                                     "while lnfuse copied it")
                file.write(chunk)
                offset += len(chunk)
                length -= len(chunk)


def _decode(buffer, offset: int, dtype: ir.DataType, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor's values from its stored bytes: mapped without a copy where numpy reads the type as stored;
    types packed below a byte are unpacked as onnx_ir unpacks a TensorProto's raw_data."""
    size = math.prod(shape)
    if dtype.bitwidth % 8 == 0:
        array = np.frombuffer(buffer, dtype=np.dtype(dtype.numpy()).newbyteorder("<"), offset=offset, count=size)
        return array.reshape(shape)
    nbytes = math.ceil(size * dtype.bitwidth / 8)
    proto = onnx.TensorProto(data_type=dtype.value, dims=shape, raw_data=bytes(buffer[offset:offset + nbytes]))
    return ir.serde.TensorProtoTensor(proto).numpy()


def ort_initializers(proto: onnx.ModelProto, gate: Gate | None
                     ) -> tuple[onnx.ModelProto, list[str], list[np.ndarray]]:
    """A model about to be handed to ONNX Runtime, and its external weights as in-memory arrays read through
    ``gate``: ORT is given these and never resolves a location itself. Constant nodes holding an external weight
    become initializers of that name (ORT takes in-memory values only for initializers). Anything external but a
    weight, or a weight without a gate, is a bug: the gate inlined the rest at load."""
    for tensor, weight in every_tensor(proto):
        if tensor.data_location == onnx.TensorProto.EXTERNAL and (gate is None or not weight):
            raise RuntimeError(f"tensor {_name(tensor)!r} still names external data where ONNX Runtime would read "
                               f"it itself, {'with no gate' if gate is None else 'outside the weights'} "
                               "(a bug in lnfuse)")
    held = [i for i, node in enumerate(proto.graph.node)
            if (value := weight_value(node)) is not None and value.data_location == onnx.TensorProto.EXTERNAL]
    if held:
        proto = onnx.ModelProto.FromString(proto.SerializeToString())  # the caller's model stays as it is
        for i in reversed(held):
            node = proto.graph.node[i]
            tensor = weight_value(node)
            tensor.name = node.output[0]
            proto.graph.initializer.append(tensor)
            del proto.graph.node[i]
    external = [t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    return proto, [t.name for t in external], [gate.array(t) for t in external]


def weight_value(node: onnx.NodeProto) -> onnx.TensorProto | None:
    """The tensor a Constant node holds as its ``value`` (where code-form models keep their weights)."""
    if not is_op(node, "Constant"):
        return None
    return next((a.t for a in node.attribute if a.name == "value" and a.HasField("t")), None)


def every_tensor(proto: onnx.ModelProto) -> Iterator[tuple[onnx.TensorProto, bool]]:
    """Every TensorProto of a model: initializers, sparse values and indices, and attribute tensors (``t``,
    ``tensors``, ``sparse_tensor``, ``sparse_tensors``) of nodes and of functions' attribute defaults, in the main
    graph, every body at any depth and every model-local function; each with whether it is a weight, which may
    stay on disk: an initializer of the main graph (lnfuse's copy for shape inference holds the small ones inline,
    ``Gate.inline``), or the value of a main-graph Constant node of more than ``WEIGHT_ELEMENTS`` elements (larger
    ones become inputs there). (A model's training_info is not read: lnfuse drops it.)"""
    main = proto.graph
    yield from ((t, True) for t in main.initializer)
    graphs: list[onnx.GraphProto] = [main]
    attributes: list[onnx.AttributeProto] = [a for f in proto.functions for a in f.attribute_proto]
    node_lists = [(f.node, False) for f in proto.functions]
    while graphs or node_lists or attributes:
        if attributes:
            attr = attributes.pop()
            if attr.HasField("t"):
                yield attr.t, False
            yield from ((t, False) for t in attr.tensors)
            for sparse in ([attr.sparse_tensor] if attr.HasField("sparse_tensor") else []) + \
                    list(attr.sparse_tensors):
                yield from ((sparse.values, False), (sparse.indices, False))
            graphs.extend([attr.g] if attr.HasField("g") else [])
            graphs.extend(attr.graphs)
            continue
        if graphs:
            graph = graphs.pop()
            if graph is not main:
                yield from ((t, False) for t in graph.initializer)
            for sparse in graph.sparse_initializer:
                yield from ((sparse.values, False), (sparse.indices, False))
            node_lists.append((graph.node, graph is main))
            continue
        nodes, in_main = node_lists.pop()
        for node in nodes:
            if not node.attribute:  # most nodes have none: a million-node graph is walked in well under a second
                continue
            constant = in_main and weight_value(node) is not None
            for attr in node.attribute:
                if constant and attr.name == "value":
                    yield attr.t, math.prod(attr.t.dims) > WEIGHT_ELEMENTS
                else:
                    attributes.append(attr)


def _name(tensor: onnx.TensorProto) -> str:
    return tensor.name if isinstance(tensor.name, str) else repr(tensor.name)


def _number(text: str, said: str, key: str) -> int:
    if not isinstance(text, str) or not text.isascii() or not text.isdigit():
        raise InputError(f"{said}: {key} {text!r} is not a non-negative whole number; re-export the model")
    return int(text)


def _tensor_bytes(tensor: onnx.TensorProto, said: str) -> int:
    """The bytes a tensor of this type and shape holds (four-bit types pack two elements a byte)."""
    elements = trust.element_count(tensor.dims, said)
    try:
        itemsize = ir.DataType(tensor.data_type).itemsize
    except ValueError:
        raise InputError(f"{said}: unknown data type {tensor.data_type}; re-export the model") from None
    if tensor.data_type in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
        raise InputError(f"{said}: a {onnx.TensorProto.DataType.Name(tensor.data_type)} tensor cannot be external "
                         "data; re-export the model")
    return math.ceil(elements * itemsize)
