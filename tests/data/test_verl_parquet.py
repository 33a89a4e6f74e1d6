"""The VERL training parquet round-trips through VERL's own RLHFDataset."""

import pandas as pd
import pytest
from omegaconf import OmegaConf
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from spader_pipeline.agent.prompts import render_prompt
from spader_pipeline.data.formats import eval_partitions, verl_rows

TEMPLATE = "Answer with JSON lists. <tool_call>[\"q\"]</tool_call>\n\nQuestion: {question}"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture
def qa() -> pd.DataFrame:
    return pd.DataFrame(
        [
            {"id": "embedded:1", "question": "Which countries are in West Africa?", "ground_truth": [["Ghana"], ["Togo", "Togolese Republic"]], "data_source": "embedded", "split": "train"},
            {"id": "embedded:2", "question": "Which planets have rings?", "ground_truth": [["Saturn"]], "data_source": "embedded", "split": "validation"},
            {"id": "mintaka:3", "question": "Who?", "ground_truth": [["X"]], "data_source": "mintaka", "split": "test"},
        ]
    )


@pytest.fixture
def tokenizer():
    vocab = {"[UNK]": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[UNK]", chat_template=CHAT_TEMPLATE)


def test_render_prompt_keeps_json_braces():
    messages = render_prompt(TEMPLATE, "Q?")
    assert messages == [{"role": "user", "content": 'Answer with JSON lists. <tool_call>["q"]</tool_call>\n\nQuestion: Q?'}]


def test_verl_parquet_roundtrip(qa, tokenizer, tmp_path):
    from verl.utils.dataset.rl_dataset import RLHFDataset

    rows = verl_rows(qa, "train", TEMPLATE, "spader_search", sources=["embedded"])
    path = tmp_path / "train.parquet"
    rows.to_parquet(path)
    config = OmegaConf.create(
        {"prompt_key": "prompt", "max_prompt_length": 256, "filter_overlong_prompts": True,
         "return_raw_chat": True, "cache_dir": str(tmp_path / "cache")}
    )
    dataset = RLHFDataset(str(path), tokenizer, config)
    assert len(dataset) == 1
    item = dataset[0]
    assert item["data_source"] == "embedded"
    assert item["agent_name"] == "spader_search"
    assert item["raw_prompt"][0]["content"].endswith("Question: Which countries are in West Africa?")
    truth = [list(entity) for entity in item["reward_model"]["ground_truth"]]
    assert truth == [["Ghana"], ["Togo", "Togolese Republic"]]
    assert item["extra_info"]["id"] == "embedded:1" and item["index"] == 0


def test_eval_partitions(qa):
    parts = eval_partitions(qa, ["validation", "test"])
    assert sorted(parts) == ["embedded_validation", "mintaka_test"]
    assert list(parts["mintaka_test"].columns) == ["id", "question", "ground_truth", "data_source"]


def test_ground_truth_lists_from_storage_shapes():
    """One normalisation of ``QARow.ground_truth`` for every reader of stored rows."""
    import numpy as np

    from spader_pipeline.data.schema import ground_truth_lists

    stored = np.array([np.array(["Ghana", "Republic of Ghana"], dtype=object), np.array(["Togo"], dtype=object)],
                      dtype=object)
    assert ground_truth_lists(stored) == [["Ghana", "Republic of Ghana"], ["Togo"]]
    assert ground_truth_lists(["Ghana", "Togo"]) == [["Ghana"], ["Togo"]]  # a flat list of names
    assert ground_truth_lists([[1, "2"]]) == [["1", "2"]]
