"""The decoder rollout server (:mod:`spader_pipeline.verl_plugin.decoder_rollout.server`) as verl's agent
loops call it: concurrent one-turn requests batched together, continued turns reusing the cache,
SGLang's per-turn token budget, log-probs, abort/resume and weight updates. In-process (the Ray actor
around it is exercised by ``test_verl_real_workers.py``)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("verl")

from spader_pipeline.verl_plugin.decoder_rollout.batching import SamplingKey, turn_budget  # noqa: E402
from spader_pipeline.verl_plugin.decoder_rollout.server import DecoderServer  # noqa: E402

PROMPT, RESPONSE, CONTEXT = 64, 32, 128
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "logprobs": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from spader_pipeline.modeling import TinyQwen3Spec, build_base_model

    texts = [f"Country {i} in West Africa. Its capital is city {i}." for i in range(40)]
    spec = TinyQwen3Spec(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=64, max_position_embeddings=512)
    return build_base_model(texts, tmp_path_factory.mktemp("server-model"), spec=spec, vocab_size=300, min_frequency=1)


def make_server(model_dir, max_num_seqs: int = 64, free_cache_engine: bool = True, **kwargs) -> DecoderServer:
    config = SimpleNamespace(prompt_length=PROMPT, response_length=RESPONSE, max_model_len=CONTEXT,
                             max_num_seqs=max_num_seqs, dtype="float32", free_cache_engine=free_cache_engine)
    return DecoderServer(config, SimpleNamespace(local_path=str(model_dir)), **kwargs)


def prompts(n: int, length: int = 12) -> list[list[int]]:
    torch.manual_seed(n)
    return torch.randint(5, 250, (n, length)).tolist()


def test_the_turn_budget_is_sglangs():
    def budget(prompt, **params):
        return turn_budget(prompt, params, max_model_len=CONTEXT, prompt_budget=PROMPT, response_length=RESPONSE)

    assert budget(10) == RESPONSE  # nothing asked: the response length
    assert budget(80) == PROMPT + RESPONSE - 80  # a long multi-turn context: what is left of the total
    assert budget(120) == 0  # past prompt + response: nothing
    assert budget(10, max_new_tokens=5) == budget(10, max_tokens=5) == 5
    assert budget(120, max_new_tokens=50) == CONTEXT - 120 - 1  # clamped to the context
    with pytest.raises(ValueError, match="exceeds the model's context"):
        budget(CONTEXT)
    params = {"max_new_tokens": 3}
    turn_budget(1, params, max_model_len=CONTEXT, prompt_budget=PROMPT, response_length=RESPONSE)
    assert params == {}  # consumed, as SGLang's server pops it


def test_sampling_keys_group_requests():
    assert SamplingKey.of({"temperature": 1.0, "top_k": 0}) == SamplingKey(1.0, 1.0, -1)
    with pytest.raises(ValueError, match="repetition_penalty"):
        SamplingKey.of({"repetition_penalty": 1.1})


def test_concurrent_requests_share_a_batch_and_return_their_log_probs(model_dir):
    async def run():
        server = make_server(model_dir)
        outs = await asyncio.gather(*[server.generate(f"r{i}", prompt_ids=p, sampling_params={**GREEDY, "max_new_tokens": 6 + i})
                                      for i, p in enumerate(prompts(6))])
        return server, outs

    server, outs = asyncio.run(run())
    stats = server.stats()
    assert stats["batch_sizes"] == [6]
    assert {"captures", "replays", "eager_steps"} <= set(stats["decoding"])  # the static step's counters
    for i, out in enumerate(outs):
        assert 1 <= len(out.token_ids) <= 6 + i and len(out.log_probs) == len(out.token_ids)
        assert out.stop_reason == "completed" and all(lp <= 0 for lp in out.log_probs)


def test_a_continued_turn_reuses_the_cache_and_decodes_what_a_fresh_server_does(model_dir):
    """verl sends each turn under a new request id; the server finds the sequence a request extends by
    its tokens. The continued batch decodes the same greedy tokens as a server that starts afresh."""
    observation = [7, 8, 9, 10]

    async def two_turns(server):
        first = await asyncio.gather(*[server.generate(f"a{i}", prompt_ids=p, sampling_params=dict(GREEDY))
                                       for i, p in enumerate(prompts(4))])
        contexts = [p + list(o.token_ids) + observation for p, o in zip(prompts(4), first, strict=True)]
        second = await asyncio.gather(*[server.generate(f"b{i}", prompt_ids=c, sampling_params=dict(GREEDY))
                                        for i, c in enumerate(reversed(contexts))])  # another arrival order
        return contexts, list(reversed(second))

    server = make_server(model_dir)
    contexts, second = asyncio.run(two_turns(server))
    decoder = next(iter(server._decoders.values()))
    assert decoder.kv_reuses == 1

    async def fresh():
        other = make_server(model_dir)
        return await asyncio.gather(*[other.generate(f"c{i}", prompt_ids=c, sampling_params=dict(GREEDY))
                                      for i, c in enumerate(contexts)])

    expected = asyncio.run(fresh())
    assert [o.token_ids for o in second] == [o.token_ids for o in expected]
    for got, want in zip(second, expected, strict=True):
        torch.testing.assert_close(torch.tensor(got.log_probs), torch.tensor(want.log_probs), atol=1e-4, rtol=1e-4)


def test_a_spent_budget_answers_at_once_and_an_oversized_prompt_is_refused(model_dir):
    async def run():
        server = make_server(model_dir)
        empty = await server.generate("x", prompt_ids=list(range(5, 5 + PROMPT + RESPONSE)), sampling_params=dict(GREEDY))
        with pytest.raises(ValueError, match="context"):
            await server.generate("y", prompt_ids=[5] * CONTEXT, sampling_params=dict(GREEDY))
        return server, empty

    server, empty = asyncio.run(run())
    assert empty.token_ids == [] and server.stats()["batches"] == 0


def test_abort_holds_requests_until_resume_or_rejects_them(model_dir):
    async def run():
        server = make_server(model_dir)
        await server.abort_all_requests()
        held = asyncio.ensure_future(server.generate("h", prompt_ids=prompts(1)[0], sampling_params=dict(GREEDY)))
        await asyncio.sleep(0.3)
        waited = not held.done()
        await server.resume_generation()
        out = await held
        await server.abort_all_requests(reject_request=True)
        rejected = await server.generate("r", prompt_ids=prompts(1)[0], sampling_params=dict(GREEDY))
        await server.resume_generation()
        again = await server.generate("s", prompt_ids=prompts(1)[0], sampling_params=dict(GREEDY))
        return waited, out, rejected, again

    waited, out, rejected, again = asyncio.run(run())
    assert waited and out.stop_reason == "completed" and out.token_ids
    assert rejected.stop_reason == "aborted" and rejected.token_ids == []
    assert again.token_ids == out.token_ids


def test_weights_arrive_in_buckets_and_every_weight_must_arrive(model_dir):
    async def run():
        server = make_server(model_dir)
        before = await server.generate("a", prompt_ids=prompts(1)[0], sampling_params=dict(GREEDY))
        weights = [(name, tensor * 0.5) for name, tensor in server.model.state_dict().items()]
        await server.load_weights(weights[:2])
        await server.load_weights(weights[2:], last=True, global_steps=3)
        after = await server.generate("b", prompt_ids=prompts(1)[0], sampling_params=dict(GREEDY))
        with pytest.raises(KeyError, match="left"):
            await server.load_weights(weights[:1], last=True)
        with pytest.raises(KeyError, match="does not have"):
            await server.load_weights([("not.a.weight", torch.zeros(1))])
        return server, before, after, weights

    server, before, after, weights = asyncio.run(run())
    for name, tensor in weights:
        torch.testing.assert_close(server.model.state_dict()[name], tensor)
    updates = server.stats()["weight_updates"]
    assert [u["global_steps"] for u in updates] == [3] and after.extra_fields["global_steps"] == 3
    assert before.log_probs != after.log_probs


def test_the_wait_for_stragglers_is_a_share_of_the_decoding_time():
    from spader_pipeline.verl_plugin.decoder_rollout.batching import MAX_WAIT_S, cohort_wait

    assert cohort_wait(0.1, 0.05) == 0.05  # a fast batch: the window
    assert cohort_wait(10.0, 0.05) == pytest.approx(0.2)  # 2% of its decoding time
    assert cohort_wait(600.0, 0.05) == MAX_WAIT_S  # capped


def _continue(contexts, outputs, observation=(7, 8, 9, 10)):
    return [c + list(o.token_ids) + list(observation) for c, o in zip(contexts, outputs, strict=True)]


def _fresh_outputs(model_dir, contexts):
    async def run():
        other = make_server(model_dir)
        return await asyncio.gather(*[other.generate(f"f{i}", prompt_ids=c, sampling_params=dict(GREEDY))
                                      for i, c in enumerate(contexts)])

    return asyncio.run(run())


def _same_as_fresh(model_dir, contexts, outputs):
    expected = _fresh_outputs(model_dir, contexts)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    for got, want in zip(outputs, expected, strict=True):
        torch.testing.assert_close(torch.tensor(got.log_probs), torch.tensor(want.log_probs), atol=1e-4, rtol=1e-4)


async def _two_cohorts(server, first, params, order=(0, 1, 2, 3)):
    """Turn 1 of four prompts in two batches (two cohorts), then turn 2 of all four arriving in ``order``:
    turn 1's outputs, turn 2's contexts and its outputs, in input order."""
    early = await asyncio.gather(*[server.generate(f"a{i}", prompt_ids=p, sampling_params=dict(params))
                                   for i, p in enumerate(first[:2])])
    late = await asyncio.gather(*[server.generate(f"b{i}", prompt_ids=p, sampling_params=dict(params))
                                  for i, p in enumerate(first[2:])])
    contexts = _continue(first, early + late)
    second = await asyncio.gather(*[server.generate(f"c{i}", prompt_ids=contexts[i], sampling_params=dict(params))
                                    for i in order])
    return [*early, *late], contexts, [second[list(order).index(i)] for i in range(len(first))]


def test_a_turn_split_in_two_batches_goes_on_as_two_cohorts_each_continuing_its_cache(model_dir):
    """Trajectories whose turns were decoded in two batches (one arrived late) come back together: each
    batch's sequences continue that batch's cache, instead of the later batch's cache alone surviving and
    every other context being encoded again."""
    async def run():
        server = make_server(model_dir)
        _, contexts, second = await _two_cohorts(server, prompts(4), GREEDY, order=[0, 2, 3, 1])  # arrivals mixed
        return server, contexts, second

    server, contexts, second = asyncio.run(run())
    stats = server.stats()
    assert stats["batch_sizes"] == [2, 2, 2, 2] and stats["kv_reuses"] == 2
    # the engine's counters, added up over the batches: each token one sampled row of a decoding step
    assert stats["sampled_rows"] == stats["generated_tokens"] > 0 and 4 <= stats["decode_steps"] < stats["sampled_rows"]
    assert 0 < stats["model_seconds"] <= stats["decode_seconds"]
    assert 0 < stats["prefill_seconds"] + stats["decoding_seconds"] <= stats["model_seconds"]
    _same_as_fresh(model_dir, contexts, second)


SAMPLED = {"temperature": 1.0, "top_p": 0.9, "top_k": -1, "logprobs": True}


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_on_the_static_step_the_server_gives_the_host_loops_turns(model_dir, params, monkeypatch):
    """The static step (modeling/graph_decode.py: what the server decodes with on CUDA, captured in graphs)
    serves two cohorts that each continue their cache, one moving out of the static cache for the other,
    and returns the host loop's tokens and log-probabilities (fp32 weights: within 1e-5), sampled too (the
    same draws from the server's seeded generator)."""
    from spader_pipeline.modeling import static_cache
    from spader_pipeline.modeling.graph_decode import static_decode_stats

    def serve(static: bool):
        monkeypatch.setattr(static_cache, "STATIC_DECODE", "on" if static else "off")

        async def run():
            server = make_server(model_dir)
            first, _, second = await _two_cohorts(server, prompts(4), params)
            return server.stats(), [*first, *second]

        return asyncio.run(run())

    host_stats, host = serve(False)
    before = static_decode_stats()
    stats, static = serve(True)
    after = static_decode_stats()
    assert after["eager_steps"] > before["eager_steps"] and after["evictions"] > before["evictions"]
    assert stats["batch_sizes"] == host_stats["batch_sizes"] and stats["kv_reuses"] == host_stats["kv_reuses"] == 2
    assert [o.token_ids for o in static] == [o.token_ids for o in host]
    for got, want in zip(static, host, strict=True):
        torch.testing.assert_close(torch.tensor(got.log_probs), torch.tensor(want.log_probs), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("free_cache_engine", [True, False], ids=["free", "keep"])
def test_sleep_lets_go_of_the_static_step_where_verl_frees_the_engine(model_dir, free_cache_engine, monkeypatch):
    """Going to sleep with ``free_cache_engine`` frees what the trainer needs, the static step's cache, graphs
    and weight copies among it, and the next turn builds its buckets again; without it they stay and serve
    the next turn as they are. Either way, after the wake-up the same request decodes the same turn."""
    from spader_pipeline.modeling import graph_decode, static_cache
    from spader_pipeline.modeling.graph_decode import static_decode_stats

    monkeypatch.setattr(static_cache, "STATIC_DECODE", "on")

    async def run():
        server = make_server(model_dir, free_cache_engine=free_cache_engine)
        before = await server.generate("a", prompt_ids=prompts(1)[0], sampling_params=dict(GREEDY))
        held, buckets = server.model in graph_decode._DECODERS, static_decode_stats()["buckets"]
        await server.sleep()
        kept = server.model in graph_decode._DECODERS
        await server.wake_up()
        after = await server.generate("b", prompt_ids=prompts(1)[0], sampling_params=dict(GREEDY))
        built = static_decode_stats()["buckets"] - buckets
        return before, after, held, kept, server.model in graph_decode._DECODERS, built

    before, after, held, kept, there, built = asyncio.run(run())
    assert held and there and kept != free_cache_engine
    assert (built > 0) == free_cache_engine  # freed: its buckets built again; kept: the same ones serve
    assert after.token_ids == before.token_ids and after.log_probs == before.log_probs


def test_a_straggler_is_prefilled_afresh_and_the_rest_continue_their_cache(model_dir):
    """A cohort whose sequences do not all come back decodes those that did once its wait is over; the
    straggler, arriving after, starts a cohort of its own; at the next turn both continue their caches."""
    first = prompts(4)

    async def run():
        server = make_server(model_dir)
        out1 = await asyncio.gather(*[server.generate(f"a{i}", prompt_ids=p, sampling_params=dict(GREEDY))
                                      for i, p in enumerate(first)])
        contexts2 = _continue(first, out1)
        out2 = list(await asyncio.gather(*[server.generate(f"b{i}", prompt_ids=c, sampling_params=dict(GREEDY))
                                           for i, c in enumerate(contexts2[:3])]))
        out2.append(await server.generate("b3", prompt_ids=contexts2[3], sampling_params=dict(GREEDY)))
        contexts3 = _continue(contexts2, out2, observation=(11, 12))
        out3 = await asyncio.gather(*[server.generate(f"c{i}", prompt_ids=c, sampling_params=dict(GREEDY))
                                      for i, c in enumerate(contexts3)])
        return server, contexts2, out2, contexts3, out3

    server, contexts2, out2, contexts3, out3 = asyncio.run(run())
    stats = server.stats()
    assert stats["batch_sizes"] == [4, 3, 1, 3, 1] and stats["kv_reuses"] == 3  # turn 2's three; turn 3's both
    _same_as_fresh(model_dir, contexts2, out2)
    _same_as_fresh(model_dir, contexts3, out3)


def test_a_cohort_all_back_decodes_without_waiting_the_window(model_dir, monkeypatch):
    from spader_pipeline.verl_plugin.decoder_rollout import server as module

    async def run():
        server = make_server(model_dir)
        out1 = await asyncio.gather(*[server.generate(f"a{i}", prompt_ids=p, sampling_params=dict(GREEDY))
                                      for i, p in enumerate(prompts(3))])
        monkeypatch.setattr(module, "MAX_WAIT_S", 60.0)  # from now on a batch that waits, waits a minute
        server.batch_window_s = 60.0
        contexts = _continue(prompts(3), out1)
        started = time.monotonic()
        await asyncio.gather(*[server.generate(f"b{i}", prompt_ids=c, sampling_params=dict(GREEDY))
                               for i, c in enumerate(contexts)])
        return server, time.monotonic() - started

    server, seconds = asyncio.run(run())
    assert server.stats()["batch_sizes"] == [3, 3] and server.stats()["kv_reuses"] == 1
    assert seconds < 30  # every sequence of the cohort came back: it decoded at once


def test_the_cohorts_caches_hold_at_most_max_num_seqs_rows(model_dir):
    async def run():
        server = make_server(model_dir, max_num_seqs=4)
        outs = []
        for k in range(3):  # three cohorts of two
            batch = prompts(6)[2 * k : 2 * k + 2]
            outs.append(await asyncio.gather(*[server.generate(f"{k}{i}", prompt_ids=p, sampling_params=dict(GREEDY))
                                               for i, p in enumerate(batch)]))
        kept = len(server._decoders)
        contexts = _continue(prompts(6)[:2], outs[0])  # the first cohort gave its cache up
        await asyncio.gather(*[server.generate(f"c{i}", prompt_ids=c, sampling_params=dict(GREEDY))
                               for i, c in enumerate(contexts)])
        return server, kept

    server, kept = asyncio.run(run())
    assert kept == 2 and server.stats()["kv_reuses"] == 0


def test_a_cohort_keeps_waiting_while_its_turns_keep_arriving(model_dir, monkeypatch):
    """Turns that come back one after another (each within the window of the last), over longer than the
    cohort's least wait, still make one batch that continues the cache."""
    from spader_pipeline.verl_plugin.decoder_rollout import server as module

    async def run():
        server = make_server(model_dir)
        out1 = await asyncio.gather(*[server.generate(f"a{i}", prompt_ids=p, sampling_params=dict(GREEDY))
                                      for i, p in enumerate(prompts(4))])
        monkeypatch.setattr(module, "MAX_WAIT_S", 60.0)
        server.batch_window_s = 1.0  # the least wait after the first turn back, and the window between turns
        contexts = _continue(prompts(4), out1)

        async def late(i, c):
            await asyncio.sleep(0.6 * i)  # the last one 1.8 s after the first
            return await server.generate(f"b{i}", prompt_ids=c, sampling_params=dict(GREEDY))

        await asyncio.gather(*[late(i, c) for i, c in enumerate(contexts)])
        return server

    stats = asyncio.run(run()).stats()
    assert stats["batch_sizes"] == [4, 4] and stats["kv_reuses"] == 1 and stats["stragglers"] == 0
