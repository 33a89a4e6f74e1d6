"""decode_batch on a grouped-query model with the ``sdpa_gqa`` attention: the tokens ``generate``
samples greedily (each row cut at its stop token or budget), and the same continuation next turn."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LogitsProcessorList

from spader_pipeline.modeling.attention import use_gqa_attention
from spader_pipeline.modeling.boundary import capture_block_output
from spader_pipeline.modeling.decode import (
    decode_batch,
    generation_processors,
    left_aligned_positions,
    retire_rows,
    sample_categorical,
    supports_decode_batch,
)
from spader_pipeline.modeling.kv_cache import GrowingKVCache
from spader_pipeline.modeling.precision import bf16_inference


def _cut(row: list[int], budget: int, stops: set[int]) -> list[int]:
    row = row[:budget]
    return next((row[: i + 1] for i, t in enumerate(row) if t in stops), row)


def test_decode_batch_equals_generate_and_continues(gqa_model_dir):
    model = AutoModelForCausalLM.from_pretrained(gqa_model_dir).eval()
    use_gqa_attention(model)
    assert supports_decode_batch(model)
    torch.manual_seed(0)
    ids = torch.randint(3, 64, (4, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = mask[3, :6] = 0
    budgets = [12, 5, 12, 8]
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=[2],
                  return_dict_in_generate=True, temperature=None, top_p=None, top_k=None)
    with torch.no_grad():
        reference = model.generate(input_ids=ids, attention_mask=mask, past_key_values=GrowingKVCache(), **kwargs)
    generated = reference.sequences[:, ids.shape[1]:].tolist()
    stops = {2, generated[0][3], generated[2][6]}  # rows end at different steps
    expected = [_cut(row, b, stops) for row, b in zip(generated, budgets, strict=True)]
    assert len({len(t) for t in expected}) > 2
    processors, do_sample = generation_processors(model, kwargs, ids)
    cache = GrowingKVCache()
    result = decode_batch(model, ids, mask, cache, budgets, eos_ids=stops, pad_id=0, processors=processors,
                          do_sample=do_sample)
    assert result.tokens == expected
    assert result.row_steps == sum(len(t) for t in expected)
    assert cache.get_seq_length() == ids.shape[1] + max(len(t) for t in expected) - 1 == result.ids.shape[1]
    assert sorted(result.cache_rows) == [0, 1, 2, 3]

    # next turn: every row's cached tokens + its last token + new tokens, against generate from scratch
    cache.batch_select_indices(torch.tensor([result.cache_rows.index(r) for r in range(4)]))
    extra = torch.randint(3, 64, (4, 3))
    rows = [list(r[m == 1].tolist()) + [t[-1]] + e.tolist()
            for r, m, t, e in zip(result.ids, result.mask, result.tokens, extra, strict=True)]
    for row, prompt, prompt_mask, turn in zip(rows, ids, mask, result.tokens, strict=True):
        assert row[:-3] == prompt[prompt_mask == 1].tolist() + turn  # the cache holds all but the last token
    width = max(len(r) for r in rows)
    fresh_ids = torch.zeros((4, width), dtype=torch.long)
    fresh_mask = torch.zeros((4, width), dtype=torch.long)
    new_ids = torch.zeros((4, 4), dtype=torch.long)
    for i, row in enumerate(rows):
        fresh_ids[i, width - len(row):] = torch.tensor(row)
        fresh_mask[i, width - len(row):] = 1
        new_ids[i] = torch.tensor(row[-4:])
    continued = decode_batch(
        model, torch.cat([result.ids, new_ids], 1), torch.cat([result.mask, torch.ones_like(new_ids)], 1), cache,
        [6] * 4, eos_ids={2}, pad_id=0, processors=processors, do_sample=False,
    )
    again = decode_batch(model, fresh_ids, fresh_mask, GrowingKVCache(), [6] * 4, eos_ids={2}, pad_id=0,
                         processors=processors, do_sample=False)
    assert continued.tokens == again.tokens


def test_rows_finishing_in_one_step_leave_together(gqa_model_dir):
    """Several rows ending at the same step, in the middle and at the end of the active rows, move
    behind the going rows in one exchange; every row still gets ``generate``'s tokens."""
    model = AutoModelForCausalLM.from_pretrained(gqa_model_dir).eval()
    use_gqa_attention(model)
    torch.manual_seed(1)
    ids = torch.randint(3, 64, (8, 7))
    mask = torch.ones_like(ids)
    mask[2, :4] = 0
    budgets = [3, 10, 3, 6, 3, 10, 6, 3]
    kwargs = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=[],
                  return_dict_in_generate=True, temperature=None, top_p=None, top_k=None)
    with torch.no_grad():
        reference = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    expected = [row[:b] for row, b in zip(reference.sequences[:, ids.shape[1]:].tolist(), budgets, strict=True)]
    processors, do_sample = generation_processors(model, kwargs, ids)
    result = decode_batch(model, ids, mask, GrowingKVCache(), budgets, eos_ids=set(), pad_id=0,
                          processors=processors, do_sample=do_sample)
    assert result.tokens == expected
    assert result.row_steps == sum(budgets)
    assert sorted(result.cache_rows) == list(range(8))
    for row in range(8):  # each row's cached ids are its prompt and all but its last token
        kept = result.ids[row][result.mask[row] == 1].tolist()
        assert kept == ids[row][mask[row] == 1].tolist() + expected[row][:-1]


def test_retire_rows_pairs_finished_rows_with_going_rows_behind_them():
    assert retire_rows([1, 4, 6], 7) == ([1], [5])
    assert retire_rows([0, 2], 4) == ([0], [3])
    assert retire_rows([5, 6], 7) == ([], [])  # already the last rows
    assert retire_rows([0, 1, 2], 3) == ([], [])
    holes, fillers = retire_rows([0, 1, 3, 8], 10)
    assert holes == [0, 1, 3] and fillers == [6, 7, 9]


def test_left_aligned_positions():
    mask = torch.tensor([[0, 1, 0, 1, 1], [1, 0, 0, 0, 1], [0, 0, 1, 1, 1]])
    index, new_mask = left_aligned_positions(mask)
    assert new_mask.tolist() == [[1, 1, 1], [0, 1, 1], [1, 1, 1]]
    assert index.tolist() == [[1, 3, 4], [0, 0, 4], [2, 3, 4]]


def test_sample_categorical_draws_each_row_from_its_distribution():
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2, 0.0], [0.0, 0.0, 0.0, 0.0, 1.0], [0.1, 0.1, 0.1, 0.1, 0.6]])
    torch.manual_seed(0)
    draws = torch.stack([sample_categorical(probs) for _ in range(20_000)])  # [N, 3]
    assert draws.shape == (20_000, 3) and draws.dtype == torch.long
    for row in range(3):
        freq = torch.bincount(draws[:, row], minlength=5).float() / draws.shape[0]
        assert torch.allclose(freq, probs[row], atol=0.015)  # ~4 standard errors
        assert (freq[probs[row] == 0] == 0).all()  # tokens cut by top-p/top-k are never drawn
    torch.manual_seed(0)
    assert torch.equal(sample_categorical(probs), draws[0])  # seeded: the same draws again


def test_sample_categorical_never_picks_a_zero_token_at_the_top_edge(monkeypatch):
    probs = torch.tensor([[0.25, 0.75, 0.0, 0.0]])
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.ones(shape, dtype=kw.get("dtype")))  # u == total
    assert sample_categorical(probs).tolist() == [1]


def test_log_probs_of_sampled_tokens_equal_a_teacher_forced_forward(gqa_model_dir):
    """What a rollout server reports (verl compares it with its actor's log-probs): each sampled token's
    log-probability at the sampling temperature, before top-k, equal to one forward over the whole
    sequence; rows of different lengths and left padding included."""
    model = AutoModelForCausalLM.from_pretrained(gqa_model_dir).eval()
    use_gqa_attention(model)
    torch.manual_seed(3)
    ids = torch.randint(3, 64, (3, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    budgets = [7, 3, 5]
    temperature = 0.7
    kwargs = dict(max_new_tokens=7, do_sample=True, temperature=temperature, top_k=20, top_p=None, pad_token_id=0,
                  eos_token_id=[], return_dict_in_generate=True)
    processors, do_sample = generation_processors(model, kwargs, ids)
    result = decode_batch(model, ids, mask, GrowingKVCache(), budgets, eos_ids=set(), pad_id=0,
                          processors=processors, do_sample=do_sample, log_prob_temperature=temperature)
    assert [len(lp) for lp in result.log_probs] == [len(t) for t in result.tokens] == budgets
    for row in range(3):
        prompt = ids[row][mask[row] == 1].tolist()
        full = torch.tensor([prompt + result.tokens[row]])
        with torch.no_grad():
            logits = model(input_ids=full).logits[0, len(prompt) - 1 : -1].float() / temperature
        expected = torch.log_softmax(logits, -1).gather(-1, full[0, len(prompt):, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(result.log_probs[row]), expected, atol=1e-4, rtol=1e-4)
    assert decode_batch(model, ids, mask, GrowingKVCache(), budgets, eos_ids=set(), pad_id=0, processors=processors,
                        do_sample=do_sample).log_probs is None


def test_a_long_fresh_prefill_in_chunks_of_rows_is_one_forwards_bit_for_bit(gqa_model_dir):
    """Rows 0-1, 2-3 and 4 as three forwards (at most 20 tokens each) against one forward of all five:
    the same tokens, log-probabilities and cache, a padded row and the boundary states included."""
    model = AutoModelForCausalLM.from_pretrained(gqa_model_dir).eval()
    use_gqa_attention(model)
    ids = torch.randint(3, 64, (5, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[3, :2] = 0

    def run(chunk_tokens):
        cache = GrowingKVCache(capture_states=True)
        with bf16_inference(model, "cpu", True), capture_block_output(model, 1):
            result = decode_batch(model, ids, mask, cache, [5] * 5, eos_ids=set(), pad_id=0,
                                  processors=LogitsProcessorList(), do_sample=False, log_prob_temperature=1.0,
                                  prefill_chunk_tokens=chunk_tokens)
        return result, cache

    (chunked, chunked_cache), (whole, whole_cache) = run(20), run(None)
    assert (chunked.tokens, chunked.log_probs) == (whole.tokens, whole.log_probs)
    assert chunked.prefill_blocks == 3 and whole.prefill_blocks == 1
    # the prefill's real tokens and computed positions (the padded row's two in both), its seconds and the steps'
    assert chunked.prefill_tokens == whole.prefill_tokens == 43 and chunked.prefill_positions == whole.prefill_positions == 45
    assert min(chunked.prefill_seconds, chunked.decoding_seconds, whole.prefill_seconds, whole.decoding_seconds) > 0
    for a, b in zip([*chunked_cache.layers, chunked_cache.states], [*whole_cache.layers, whole_cache.states],
                    strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_a_continued_prefill_is_cut_into_blocks_by_its_devices_cost(gqa_model_dir, monkeypatch):
    """``prefill_block_cost="auto"``: the CPU's cost on a CPU (blocks of rows of similar length), the GPU's
    elsewhere, where a forward's fixed cost is many token positions (here: one forward for the same rows)."""
    from spader_pipeline.modeling import decode

    assert decode.prefill_block_cost_for("cpu") == decode.PREFILL_BLOCK_COST
    assert decode.prefill_block_cost_for(torch.device("cuda", 0)) == decode.GPU_PREFILL_BLOCK_COST
    model = AutoModelForCausalLM.from_pretrained(gqa_model_dir).eval()
    use_gqa_attention(model)
    generator = torch.Generator().manual_seed(5)
    first = torch.randint(3, 64, (6, 4), generator=generator)
    new = [1, 2, 9, 10, 17, 18]  # three pairs of lengths: three blocks at a small fixed cost a forward

    def continued(cost):
        cache = GrowingKVCache()
        call = dict(eos_ids=set(), pad_id=0, processors=LogitsProcessorList(), do_sample=False)
        result = decode_batch(model, first, torch.ones_like(first), cache, [1] * 6, **call)
        assert result.cache_rows == list(range(6))  # the cache's rows in the input's order
        block = torch.zeros((6, max(new)), dtype=torch.long)
        block_mask = torch.zeros_like(block)
        for row, count in enumerate(new):
            block[row, -count:] = torch.randint(3, 64, (count,), generator=torch.Generator().manual_seed(row))
            block_mask[row, -count:] = 1
        ids, mask = torch.cat([result.ids, block], 1), torch.cat([result.mask, block_mask], 1)
        return decode_batch(model, ids, mask, cache, [3] * 6, prefill_block_cost=cost, **call)

    monkeypatch.setattr(decode, "PREFILL_BLOCK_COST", (0, 4))
    on_cpu = continued("auto")
    assert on_cpu.prefill_blocks == continued((0, 4)).prefill_blocks == 3
    monkeypatch.setattr(decode, "prefill_block_cost_for", lambda device: decode.GPU_PREFILL_BLOCK_COST)
    as_on_a_gpu = continued("auto")
    assert as_on_a_gpu.prefill_blocks == 1
    assert as_on_a_gpu.tokens == on_cpu.tokens == continued(None).tokens
    # the same 57 new tokens; the blocks compute 2 x (2 + 10 + 18) positions, one forward 6 x 18
    assert on_cpu.prefill_tokens == as_on_a_gpu.prefill_tokens == sum(new)
    assert (on_cpu.prefill_positions, as_on_a_gpu.prefill_positions) == (60, 108)
