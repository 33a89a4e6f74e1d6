"""VERL's FSDP merger on real FSDP actor checkpoints of the tiny model: one rank laid out by hand, and
two ranks saved by verl's own checkpoint manager (what a node writes), merged by a real Kedro run of
the ``merge`` pipeline."""

from __future__ import annotations

import json

import pytest
import torch
from fsdp_ranks import save_sharded_actor
from kedro.framework.session import KedroSession
from transformers import AutoModelForCausalLM, AutoTokenizer

from spader_pipeline.launch.merge import merge_command, merge_fsdp_checkpoint
from spader_pipeline.modeling import TinyQwen3Spec, build_base_model
from spader_pipeline.pipelines.merge.nodes import merge_policy


def _tiny_model(path):
    spec = TinyQwen3Spec(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         intermediate_size=64, max_position_embeddings=256)
    return build_base_model(["alpha beta gamma delta"] * 20, path, spec=spec, vocab_size=300, min_frequency=1)


def _fsdp_actor(tmp_path):
    """An actor directory laid out as VERL's FSDP checkpoint manager writes it (world size 1)."""
    model_dir = _tiny_model(tmp_path / "hf")
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


@pytest.mark.heavy
@pytest.mark.slow
def test_two_fsdp_ranks_merge_through_the_merge_pipeline_into_the_unsharded_weights(kedro_project):
    """What a node writes: 2 FSDP ranks (gloo on the CPU) save the actor with verl's own checkpoint
    manager; a real ``kedro run --pipeline merge`` turns it into a Hugging Face folder whose weights
    are the unsharded ones, bit for bit."""
    model_dir = _tiny_model(kedro_project / "hf")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():  # weights that bf16 holds exactly: the merger writes bf16, so equality is exact
        for tensor in model.state_dict().values():
            tensor.copy_(tensor.to(torch.bfloat16).float())
    model.save_pretrained(model_dir)
    run = kedro_project / "data/06_models/train_spader"
    actor = save_sharded_actor(model_dir, run / "checkpoints/global_step_2/actor", world_size=2)

    assert json.loads((actor / "fsdp_config.json").read_text())["world_size"] == 2
    shards = [torch.load(actor / f"model_world_size_2_rank_{rank}.pt", weights_only=False) for rank in (0, 1)]
    weight = "model.layers.0.mlp.gate_proj.weight"  # each rank holds its half of every weight
    assert [s[weight].to_local().shape[0] for s in shards] == [32, 32] and model.state_dict()[weight].shape[0] == 64
    (run / "policy_manifest.json").write_text(json.dumps(
        {"backend": "verl", "method": "spader", "checkpoint": str(actor.parent), "actor_dir": str(actor), "path": None}))
    grpo = kedro_project / "data/06_models/train_grpo"  # the other default method: a native run, passed through
    grpo.mkdir(parents=True)
    (grpo / "policy_manifest.json").write_text(json.dumps({"backend": "native", "method": "grpo", "path": str(model_dir)}))

    with KedroSession.create(project_path=kedro_project, env="test") as session:
        session.run(pipeline_names=["merge"])

    manifest = json.loads((run / "model_manifest.json").read_text())
    merged_dir = kedro_project / "data/06_models/merged/train_spader"
    assert manifest["merged"] and manifest["path"] == str(merged_dir.resolve())
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).state_dict()
    unsharded = model.state_dict()
    assert set(merged) == set(unsharded)
    for name, tensor in unsharded.items():
        assert torch.equal(merged[name], tensor), name
    assert AutoTokenizer.from_pretrained(merged_dir).get_vocab() == AutoTokenizer.from_pretrained(model_dir).get_vocab()
