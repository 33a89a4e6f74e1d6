"""A GGUF file read once (``modeling.gguf_checkpoint``) gives what transformers' own GGUF loader gives: the same
metadata as the ``gguf`` package's reader, the same settings and tensors as ``load_gguf_checkpoint``, and
the same converted folder as ``from_pretrained(gguf_file=...)``, on the embedded default's file and on a
small file of other tensor types and another tokenizer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint as transformers_checkpoint

from spader_pipeline.modeling.gguf_checkpoint import load_gguf_checkpoint, plain_architecture, read_gguf
from spader_pipeline.modeling.packaged import (
    PackagedModel,
    convert_packaged_model,
    load_gguf,
    locate_packaged_file,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_vs_llamacpp  # noqa: E402

SETTINGS = ("config", "tokenizer", "tokenizer_config", "ignore")
#: what ``from_pretrained`` writes about where it loaded the tokenizer from (reset by every later load), and
#: ``add_prefix_space``, which its path writes as false and ours leaves out (false when read back either way)
LOADING_RECORDS = {"is_local", "local_files_only", "add_prefix_space"}


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, rms_norm_eps=1e-5,
                         rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    return LlamaForCausalLM(config)


def _same_tensors(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert set(ours) == set(theirs)
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor), name


@pytest.mark.slow
def test_the_packaged_file_reads_as_the_gguf_package_reads_it():
    from gguf import GGUFReader
    from transformers.integrations.ggml import _gguf_parse_value

    path = locate_packaged_file(PackagedModel())
    ours, reader = read_gguf(path), GGUFReader(path)
    theirs = {key: field for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    assert list(ours.fields) == list(theirs)
    for key, field in theirs.items():
        types, values = ours.fields[key]
        assert types == list(field.types), key
        assert values == [_gguf_parse_value(field.parts[i], field.types) for i in field.data], key
    assert [(t.name, t.shape, t.ggml_type, t.offset) for t in ours.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), t.data_offset) for t in reader.tensors]
    assert plain_architecture(ours)


@pytest.mark.slow
def test_the_packaged_files_settings_are_transformers():
    path = locate_packaged_file(PackagedModel())
    ours, theirs = load_gguf_checkpoint(read_gguf(path)), transformers_checkpoint(str(path))
    for part in SETTINGS:
        assert ours[part] == theirs[part], part


def test_a_small_file_of_bf16_and_fp32_tensors_and_an_spm_vocabulary_loads_as_transformers_loads_it(tmp_path):
    path = bench_vs_llamacpp.synthetic_gguf(_tiny_llama(), tmp_path / "model.gguf")
    contents = read_gguf(path)
    assert {t.ggml_type for t in contents.tensors} == {0, 30}  # F32 norms, BF16 matrices
    theirs_settings = transformers_checkpoint(str(path))
    for part in SETTINGS:
        assert load_gguf_checkpoint(contents)[part] == theirs_settings[part], part
    model, tokenizer = load_gguf(path)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name)
    reference_tokenizer = PreTrainedTokenizerFast.from_pretrained(tmp_path, gguf_file=path.name)
    assert model.config.to_dict() == reference.config.to_dict()
    _same_tensors(model.state_dict(), reference.state_dict())
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, as in the file
    assert tokenizer.backend_tokenizer.to_str() == reference_tokenizer.backend_tokenizer.to_str()
    ids = torch.tensor([[1, 5, 9, 200]])
    assert torch.equal(model(ids).logits, reference(ids).logits)


def test_a_file_that_is_not_gguf_is_refused_by_name(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(path)


def test_an_architecture_with_a_case_of_its_own_goes_through_transformers(tmp_path):
    path = bench_vs_llamacpp.synthetic_gguf(_tiny_llama(), tmp_path / "model.gguf")
    contents = read_gguf(path)
    renamed = type(contents)(path=contents.path, version=contents.version,
                             fields={**contents.fields, "general.name": ([8], ["mistral"])}, tensors=contents.tensors)
    assert plain_architecture(contents) and not plain_architecture(renamed)  # transformers reads it as Mistral
    with pytest.raises(ValueError, match="transformers' own GGUF loader"):
        load_gguf_checkpoint(renamed)


@pytest.mark.heavy
@pytest.mark.slow
def test_the_embedded_defaults_folder_is_the_one_from_pretrained_writes(tmp_path):
    spec = PackagedModel()
    path = locate_packaged_file(spec)
    ours_dir, theirs_dir = tmp_path / "ours", tmp_path / "theirs"
    assert convert_packaged_model(spec, ours_dir) == convert_packaged_model(spec, theirs_dir, through_transformers=True)
    names = sorted(p.name for p in theirs_dir.iterdir())
    assert sorted(p.name for p in ours_dir.iterdir()) == names
    for name in names:
        if name == "tokenizer_config.json":
            ours, theirs = (json.loads((d / name).read_text()) for d in (ours_dir, theirs_dir))
            assert {k: v for k, v in ours.items() if k not in LOADING_RECORDS} == {
                k: v for k, v in theirs.items() if k not in LOADING_RECORDS}
        else:
            assert (ours_dir / name).read_bytes() == (theirs_dir / name).read_bytes(), name
    # the tokenizers read back alike (leading spaces, the chat template, special tokens)
    text = [{"role": "user", "content": "  Which films did Mel Brooks direct?\n<|im_end|> x"}]
    ours_tok, theirs_tok = AutoTokenizer.from_pretrained(ours_dir), AutoTokenizer.from_pretrained(theirs_dir)
    assert ours_tok.apply_chat_template(text, add_generation_prompt=True) == theirs_tok.apply_chat_template(
        text, add_generation_prompt=True)
    assert ours_tok(" a  b").input_ids == theirs_tok(" a  b").input_ids
    # and the tensors before saving are transformers' own
    model = AutoModelForCausalLM.from_pretrained(ours_dir, device_map="meta")
    ours = load_gguf_checkpoint(read_gguf(path), model)["tensors"]
    _same_tensors(ours, transformers_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"])
    assert all(np.isfinite(t.numpy()).all() for t in ours.values())


def test_a_transformers_without_the_pieces_converts_through_from_pretrained(tmp_path, monkeypatch, caplog):
    import transformers.integrations.ggml as ggml

    path = bench_vs_llamacpp.synthetic_gguf(_tiny_llama(), tmp_path / "model.gguf")
    monkeypatch.delattr(ggml, "convert_gguf_tokenizer")  # bound already where from_pretrained reads it
    with caplog.at_level("WARNING", logger="spader_pipeline.modeling.packaged"):
        model, tokenizer = load_gguf(path)
    assert "through from_pretrained" in caplog.text
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name)
    _same_tensors(model.state_dict(), reference.state_dict())
