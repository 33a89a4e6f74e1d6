"""VERL's FSDP merger on a real (single-rank) FSDP-format actor checkpoint of the tiny model."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from spader_pipeline.launch.merge import merge_command, merge_fsdp_checkpoint
from spader_pipeline.modeling import TinyQwen3Spec, build_base_model
from spader_pipeline.pipelines.merge.nodes import merge_policy


def _fsdp_actor(tmp_path):
    """An actor directory laid out as VERL's FSDP checkpoint manager writes it (world size 1)."""
    spec = TinyQwen3Spec(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         intermediate_size=64, max_position_embeddings=256)
    model_dir = build_base_model(["alpha beta gamma delta"] * 20, tmp_path / "hf", spec=spec, vocab_size=300, min_frequency=1)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    actor = tmp_path / "global_step_2" / "actor"
    (actor / "huggingface").mkdir(parents=True)
    torch.save(model.state_dict(), actor / "model_world_size_1_rank_0.pt")
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 1}))
    model.config.save_pretrained(actor / "huggingface")
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(actor / "huggingface")
    return actor, model


def test_merge_command_is_verls_cli(tmp_path):
    cmd = merge_command(tmp_path / "a", tmp_path / "b")
    assert cmd[1:6] == ["-m", "verl.model_merger", "merge", "--backend", "fsdp"]


@pytest.mark.slow
def test_fsdp_checkpoint_merges_into_a_loadable_hf_directory(tmp_path):
    """The merge node runs verl's own merger CLI once (a fresh verl process) on an FSDP actor."""
    actor, model = _fsdp_actor(tmp_path)
    manifest = merge_policy({"backend": "verl", "method": "spader", "actor_dir": str(actor)},
                            {"output_dir": str(tmp_path / "merged")})
    out = tmp_path / "merged" / "train_spader"
    assert manifest["merged"] and manifest["path"] == str(out.resolve()) and (out / "merge.log").is_file()
    merged = AutoModelForCausalLM.from_pretrained(out)
    for name, tensor in model.state_dict().items():  # the merger writes bf16 weights
        assert torch.equal(tensor.to(torch.bfloat16), merged.state_dict()[name].to(torch.bfloat16)), name


def test_native_policies_pass_through_and_bad_dirs_are_explained(tmp_path):
    manifest = {"backend": "native", "method": "grpo", "path": "/x"}
    assert merge_policy(manifest, {})["path"] == "/x"
    with pytest.raises(FileNotFoundError, match="fsdp_config.json"):
        merge_fsdp_checkpoint(tmp_path, tmp_path / "out")
