"""Models loaded from a path a user gives never run code: safetensors only, no remote code
(docs/reliability.md)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from spader_pipeline.agent.openai_backend import server_command
from spader_pipeline.modeling import load_model_and_tokenizer, validate_model_dir


class _RunsACommand:
    """Unpickling this calls ``os.system`` (a planted ``pytorch_model.bin``)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _copy_without_weights(src, dst):
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    return dst


def test_a_folder_of_pickled_weights_is_refused_and_nothing_runs(tiny_model_dir, tmp_path):
    folder = _copy_without_weights(tiny_model_dir, tmp_path / "model")
    marker = tmp_path / "pwned"
    torch.save({"model.embed_tokens.weight": _RunsACommand(marker)}, folder / "pytorch_model.bin")
    for load in (load_model_and_tokenizer, validate_model_dir):
        with pytest.raises(ValueError, match="pytorch_model.bin.*safetensors"):
            load(folder)
    with pytest.raises(ValueError, match="pickled weights"):
        server_command("vllm", folder, 8001, "m")
    assert not marker.exists()


def test_remote_code_in_a_model_folder_is_never_run(tiny_model_dir, tmp_path):
    """``trust_remote_code`` stays off: a config that names its own Python classes (``auto_map``) gets
    the library's class for its model type, or an error for an unknown type; its code never runs."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    marker = tmp_path / "pwned"
    (folder / "evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n"
                                    "from transformers import Qwen3Config as EvilConfig\n")
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilConfig"}
    (folder / "config.json").write_text(json.dumps(config))
    model, _ = load_model_and_tokenizer(folder)
    assert type(model).__module__.startswith("transformers.models.qwen3")
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "evil"}))
    for load in (load_model_and_tokenizer, validate_model_dir):
        with pytest.raises(ValueError):
            load(folder)
    assert not marker.exists()


def test_served_checkpoints_load_safetensors_without_remote_code():
    argv = server_command("vllm", "/m", 8001, "qwen")
    assert argv[argv.index("--load-format") + 1] == "safetensors" and "--trust-remote-code" not in argv
    with pytest.raises(ValueError, match="trust-remote-code"):
        server_command("sglang", "/m", 8001, "qwen", extra_args=["--trust-remote-code"])
