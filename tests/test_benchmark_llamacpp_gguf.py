"""The GGUF that llama.cpp's side of the GPU decoding benchmark runs (``bench_vs_llamacpp.synthetic_gguf``):
the benchmark's random model written in llama.cpp's ``llama`` architecture without a model folder or a
tokenizer. Read back by transformers' own GGUF loader (which undoes the converter's rotary reordering), it
is the same model: the same tensors, bit for bit at bf16, so llama.cpp is timed on our weights and shape."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_vs_llamacpp  # noqa: E402


def _tiny_llama(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, rms_norm_eps=1e-5,
                         rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, **overrides)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for weight in model.parameters():
            if weight.dim() == 1:  # norms away from 1, so a norm read as another would show
                weight.uniform_(0.5, 1.5)
    return model


def test_synthetic_gguf_reads_back_as_the_same_model(tmp_path):
    model = _tiny_llama()
    path = bench_vs_llamacpp.synthetic_gguf(model, tmp_path / "model.gguf")
    back = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    ours, theirs = model.state_dict(), back.state_dict()
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        expected = tensor if tensor.dim() == 1 else tensor.to(torch.bfloat16).float()  # norms kept in fp32
        assert torch.equal(theirs[name].float(), expected), name
    config = back.config
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (4, 2, 320)
    assert config.rope_parameters["rope_theta"] == 10000.0


def test_synthetic_gguf_has_a_vocabulary_of_the_models_size(tmp_path):
    import gguf

    path = bench_vs_llamacpp.synthetic_gguf(_tiny_llama(), tmp_path / "model.gguf")
    reader = gguf.GGUFReader(path)
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == 320
    texts = [bytes(tokens.parts[i]).decode() for i in tokens.data]
    assert texts[:3] == ["<unk>", "<s>", "</s>"] and "<0x0A>" in texts  # llama.cpp looks up the newline byte


def test_synthetic_gguf_refuses_what_it_would_write_wrongly(tmp_path):
    with pytest.raises(ValueError, match="tied embeddings"):
        bench_vs_llamacpp.synthetic_gguf(_tiny_llama(attention_bias=True), tmp_path / "model.gguf")
