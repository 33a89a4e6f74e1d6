"""A GGUF checkpoint read once, as transformers reads it: its settings, tokenizer and tensors.

transformers converts a GGUF file with the ``gguf`` package's ``GGUFReader``, which builds every metadata
value as numpy views, one element at a time: SmolLM2's file (49,152 tokens, 48,900 merges) takes ~3 s to
open, and ``from_pretrained`` opens it three times (the configuration, the tokenizer, the model), then
builds the GGUF-to-transformers name map once per module (397 times): ~18 s of the embedded default's
base-model stage, most of it before a weight is read (docs/performance.md). :func:`read_gguf` parses the
same file format (GGUF v2/v3: header, key/value metadata, tensor descriptions, aligned data) with
``struct`` in one pass over the metadata, and :func:`load_gguf_checkpoint` returns what transformers'
``modeling_gguf_pytorch_utils.load_gguf_checkpoint`` returns for the architectures it handles without
special cases (:data:`PLAIN_ARCHITECTURES`): the same settings dictionaries (through transformers' own
mapping tables), and, given the model to load, the same tensors (``gguf``'s own dequantisation and
transformers' own tensor processor, the name map built once). ``tests/modeling/test_modeling_gguf_checkpoint.py``
holds the two equal, and the converted folder equal file for file.

Where a file needs one of transformers' special cases (another architecture, a Mistral named as Llama),
:func:`plain_architecture` is false and the caller converts through transformers as before.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["GGUFContents", "GGUFTensorInfo", "PLAIN_ARCHITECTURES", "gguf_tensors", "load_gguf_checkpoint",
           "plain_architecture", "read_gguf"]

#: architectures transformers converts without a case of its own (renames, defaults, tensors read from
#: other tensors): the settings and tensors here are transformers' for these only
PLAIN_ARCHITECTURES = frozenset({"llama", "qwen2", "qwen3"})

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
#: GGUF value types (the spec's ``gguf_type``): struct format of the scalars
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_INTEGERS, _FLOATS, _BOOL = frozenset({0, 1, 2, 3, 4, 5, 10, 11}), frozenset({6, 12}), 7


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor's description: ``shape`` in GGUF's order (innermost first, as the file and ``ReaderTensor.shape``
    have it), its GGML type's number, and its data's offset from the start of the file."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int


@dataclass(frozen=True)
class GGUFContents:
    """A GGUF file's metadata: ``fields`` maps each key to ``(types, values)`` (``types`` as ``ReaderField.types``:
    ``[type]``, or ``[9, element type]`` for an array; ``values`` the list of its values, one for a scalar),
    and its tensors' descriptions in the file's order."""

    path: Path
    version: int
    fields: dict[str, tuple[list[int], list[Any]]]
    tensors: list[GGUFTensorInfo]

    def value(self, key: str, default: Any = None) -> Any:
        """The key's value as transformers reads it (a one-element list as its element), or ``default``."""
        if key not in self.fields:
            return default
        values = self.fields[key][1]
        return values[0] if len(values) == 1 else values


class _Cursor:
    """Little-endian reads from a buffer, moving forward."""

    def __init__(self, buffer: Any, offset: int = 0) -> None:
        self.buffer, self.offset = buffer, offset

    def scalar(self, code: str) -> Any:
        (value,) = struct.unpack_from("<" + code, self.buffer, self.offset)
        self.offset += struct.calcsize(code)
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        start = self.offset
        self.offset += length
        return bytes(self.buffer[start : self.offset]).decode("utf-8")

    def strings(self, count: int) -> list[str]:
        buffer, offset, out = self.buffer, self.offset, []
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            (length,) = unpack(buffer, offset)
            offset += 8
            out.append(bytes(buffer[offset : offset + length]).decode("utf-8"))
            offset += length
        self.offset = offset
        return out

    def array(self, code: str, count: int) -> list[Any]:
        values = list(struct.unpack_from(f"<{count}{code}", self.buffer, self.offset))
        self.offset += count * struct.calcsize(code)
        return values


def _python_value(value: Any, value_type: int) -> Any:
    """A value as transformers' ``_gguf_parse_value`` gives it: ``int``, ``float`` (a float32's exact value),
    ``bool`` or ``str``."""
    if value_type in _INTEGERS:
        return int(value)
    if value_type in _FLOATS:
        return float(value)
    if value_type == _BOOL:
        return bool(value)
    return value


def _read_value(cursor: _Cursor, value_type: int) -> tuple[list[int], list[Any]]:
    if value_type == _STRING:
        return [value_type], [cursor.string()]
    if value_type in _SCALARS:
        return [value_type], [_python_value(cursor.scalar(_SCALARS[value_type]), value_type)]
    if value_type != _ARRAY:
        raise ValueError(f"unknown GGUF value type {value_type}")
    element_type, count = cursor.scalar("I"), cursor.scalar("Q")
    if element_type == _STRING:
        return [_ARRAY, element_type], cursor.strings(count)
    if element_type not in _SCALARS:
        raise ValueError(f"GGUF arrays of type {element_type} are not read here")
    return [_ARRAY, element_type], [_python_value(v, element_type)
                                    for v in cursor.array(_SCALARS[element_type], count)]


def read_gguf(path: str | Path) -> GGUFContents:
    """The metadata and tensor descriptions of the GGUF file at ``path`` (versions 2 and 3), in one pass."""
    path = Path(path)
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as view:
        cursor = _Cursor(view)
        if bytes(view[:4]) != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (magic {bytes(view[:4])!r})")
        cursor.offset = 4
        version = cursor.scalar("I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not read here (2 and 3 are)")
        tensor_count, field_count = cursor.scalar("Q"), cursor.scalar("Q")
        fields: dict[str, tuple[list[int], list[Any]]] = {}
        for _ in range(field_count):
            key = cursor.string()
            fields[key] = _read_value(cursor, cursor.scalar("I"))
        described = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = cursor.array("Q", cursor.scalar("I"))
            described.append((name, tuple(dims), cursor.scalar("I"), cursor.scalar("Q")))
        alignment = fields.get("general.alignment", ([], [DEFAULT_ALIGNMENT]))[1][0]
        start = -(-cursor.offset // alignment) * alignment
    names = [d[0] for d in described]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: a tensor name appears twice")
    tensors = [GGUFTensorInfo(name, dims, ggml_type, start + offset) for name, dims, ggml_type, offset in described]
    return GGUFContents(path=path, version=version, fields=fields, tensors=tensors)


def plain_architecture(contents: GGUFContents) -> bool:
    """Whether transformers converts this file without a special case (:data:`PLAIN_ARCHITECTURES`; not a
    Mistral that llama.cpp names ``llama``), so that :func:`load_gguf_checkpoint` gives its result."""
    architecture = contents.value("general.architecture")
    names = contents.fields.get("general.name", ([], []))[1]
    return architecture in PLAIN_ARCHITECTURES and "mistral" not in names


def _settings(contents: GGUFContents) -> dict[str, dict[str, Any]]:
    """The ``config``, ``tokenizer`` and ``tokenizer_config`` dictionaries, renamed by transformers' own tables."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING
    from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING

    architecture = contents.value("general.architecture")
    parsed: dict[str, dict[str, Any]] = {name: {} for name in GGUF_TO_TRANSFORMERS_MAPPING}
    # the header's counts, which GGUFReader lists as fields first
    parsed["ignore"].update(version=contents.version, tensor_count=len(contents.tensors),
                            kv_count=len(contents.fields))
    parsed["config"]["tie_word_embeddings"] = all(t.name != "output.weight" for t in contents.tensors)
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture, {}).items():
        parsed["config"].setdefault(key, value)
    for key in contents.fields:
        prefix, _, rest = key.partition(".")
        value = contents.value(key)
        for parameter, renames in GGUF_TO_TRANSFORMERS_MAPPING.items():
            renamed = renames.get(prefix, {}).get(rest, -1)  # -1: not this parameter's; None: known, unused
            if renamed is not None and renamed != -1:
                parsed[parameter][renamed] = value
    if "vocab_size" not in parsed["config"] and "tokens" in parsed["tokenizer"]:
        parsed["config"]["vocab_size"] = len(parsed["tokenizer"]["tokens"])
    return parsed


def _tensor_data(view: np.ndarray, tensor: GGUFTensorInfo) -> np.ndarray:
    """The tensor's data as ``GGUFReader`` lays it out: typed values in numpy's order (outermost first), or a
    quantised type's bytes by row (``gguf.quants.quant_shape_to_byte_shape``)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    kind = GGMLQuantizationType(tensor.ggml_type)
    shape = tuple(reversed(tensor.shape))
    count = int(np.prod(tensor.shape))
    typed = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
             GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
             GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64}
    if kind in typed:
        dtype = np.dtype(typed[kind])
        return view[tensor.offset : tensor.offset + count * dtype.itemsize].view(dtype).reshape(shape)
    block, size = GGML_QUANT_SIZES[kind]
    return view[tensor.offset : tensor.offset + count * size // block].reshape(quant_shape_to_byte_shape(shape, kind))


def _weights_map(model: Any, processor: Any, architecture: str) -> dict[str, str]:
    """GGUF tensor name → the model's parameter name, from ``gguf``'s name table built once (transformers
    walks every module and builds it for each; for these architectures the top level finds every name)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next(key for key, value in MODEL_ARCH_NAMES.items() if value == architecture)
    names = get_tensor_name_map(arch, model.config.num_hidden_layers)
    mapping = {}
    for hf_name in model.state_dict():
        hf_name = processor.preprocess_name(hf_name)
        base, suffix = hf_name, ""
        if hf_name.endswith((".weight", ".bias")):
            base, dot, kind = hf_name.rpartition(".")
            suffix = dot + kind
        gguf_name = names.get_name(base)
        if gguf_name is not None:
            mapping[gguf_name + suffix] = hf_name
    return mapping


def load_gguf_checkpoint(contents: GGUFContents, model: Any = None) -> dict[str, dict[str, Any]]:
    """transformers' ``load_gguf_checkpoint(path, return_tensors=model is not None, model_to_load=model)`` for a
    file of :func:`plain_architecture`: ``{"config", "tokenizer", "tokenizer_config", "ignore"}`` and, with
    ``model``, ``"tensors"`` (:func:`gguf_tensors`)."""
    if not plain_architecture(contents):
        raise ValueError(f"{contents.path}: architecture {contents.value('general.architecture')!r} needs "
                         "transformers' own GGUF loader")
    parsed = _settings(contents)
    if model is not None:
        parsed["tensors"] = gguf_tensors(contents, parsed, model)
    return parsed


def gguf_tensors(contents: GGUFContents, parsed: dict[str, dict[str, Any]], model: Any) -> dict[str, Any]:
    """The file's tensors for ``model`` (a model of its configuration, e.g. on the meta device), given its settings
    ``parsed`` (:func:`load_gguf_checkpoint` without a model): parameter name → fp32 ``torch.Tensor``, dequantised
    by ``gguf``, then transformers' tensor processor for the architecture (e.g. Llama's query and key rows put
    back in transformers' rotary order)."""
    import torch
    from gguf import dequantize
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    architecture = contents.value("general.architecture")
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed["config"])
    mapping = _weights_map(model, processor, architecture)
    tensors = {}
    view = np.memmap(contents.path, dtype=np.uint8, mode="r")
    for tensor in contents.tensors:
        weights = dequantize(_tensor_data(view, tensor), tensor.ggml_type)
        result = processor.process(weights=weights, name=tensor.name, tensor_key_mapping=mapping,
                                   parsed_parameters=parsed)
        if result.name in mapping:
            tensors[mapping[result.name]] = torch.from_numpy(np.copy(result.weights))
    return tensors
