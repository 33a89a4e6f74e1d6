"""The Continuous-Token builder's renders kept per distinct messages (``agent.tokens.memoize_renders``): the
same token layouts as VERL's builder unchanged, each distinct render made once."""

from __future__ import annotations

import pytest
from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

from spader_pipeline.agent.tokens import encode_dialogue, make_token_builder, memoize_renders

DIALOGUES = [
    [{"role": "user", "content": f"Question {q}: which rivers flow into the lake?"},
     {"role": "assistant", "content": '<think>x</think><tool_call>["rivers lake"]</tool_call>'},
     {"role": "user", "content": "<tool_response>\nDoc 1 (Title: River A) flows into the lake.\n</tool_response>"},
     {"role": "assistant", "content": f'<tool_call>["river {q}"]</tool_call>'},
     {"role": "user", "content": f"<tool_response>\nDoc 1 (Title: River {q}) a river.\n</tool_response>"},
     {"role": "assistant", "content": '<answer>["River A"]</answer>'}]
    for q in ("one", "two", "one")
]


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_dialogues_encode_as_with_verls_builder_unchanged(tiny_lm, model_type):
    _, tokenizer = tiny_lm
    plain = create_continuous_token_builder(tokenizer, hf_model_type=model_type, chat_template_kwargs={})
    kept = make_token_builder(tokenizer, model_type)
    for dialogue in DIALOGUES + DIALOGUES:  # the second time every render is a kept one
        assert encode_dialogue(dialogue, tokenizer, builder=kept) == encode_dialogue(dialogue, tokenizer, builder=plain)


def test_each_distinct_render_is_made_once_and_unhashable_messages_go_through(tiny_lm):
    _, tokenizer = tiny_lm
    builder = create_continuous_token_builder(tokenizer, hf_model_type="qwen3", chat_template_kwargs={})
    made: list[int] = []
    render = builder._render_tokens

    def counted(messages, *, add_generation_prompt, tools=None):
        made.append(len(messages))
        return render(messages, add_generation_prompt=add_generation_prompt, tools=tools)

    builder._render_tokens = counted
    memoize_renders(builder, size=64)
    for dialogue in DIALOGUES:
        encode_dialogue(dialogue, tokenizer, builder=builder)
    assert made.count(2) == 1  # the synthetic prefix (system and user) every observation is cut from, once
    assert made.count(3) == 3  # the distinct observations after it: the shared first one, two second ones
    first = len(made)
    for dialogue in DIALOGUES:
        encode_dialogue(dialogue, tokenizer, builder=builder)
    assert len(made) == first  # nothing rendered again
    ids = builder._render_tokens([{"role": "user", "content": "x"}], add_generation_prompt=True)
    ids.append(-1)  # a caller's list is its own
    assert builder._render_tokens([{"role": "user", "content": "x"}], add_generation_prompt=True)[-1] != -1
    listed = [{"role": "user", "content": "x", "extra": ["not", "hashable"]}]
    before = len(made)
    builder._render_tokens(listed, add_generation_prompt=True)
    builder._render_tokens(listed, add_generation_prompt=True)
    assert len(made) == before + 2


def test_a_full_memo_starts_over(tiny_lm):
    _, tokenizer = tiny_lm
    builder = memoize_renders(create_continuous_token_builder(tokenizer, hf_model_type="qwen3",
                                                              chat_template_kwargs={}), size=2)
    renders = [builder._render_tokens([{"role": "user", "content": f"q{i}"}], add_generation_prompt=False)
               for i in range(5)]
    assert renders == [builder._render_tokens([{"role": "user", "content": f"q{i}"}], add_generation_prompt=False)
                       for i in range(5)]
