"""Training hot paths: the warm-start SFT step and the RL log-probability pass.

    .venv/bin/python benchmarks/bench_training.py [--repeats 5] [--examples 64] [--threads 1]

Both on the embedded default architecture (tiny Qwen3: hidden 256, 4 layers, 8k vocabulary),
sequences shaped like warm-start demonstrations (~350–650 tokens, ~10% model tokens):

* **SFT step** (forward + backward on ``batch_tokens`` padded tokens): the straightforward loop —
  random batches of fixed size, full ``model(...).logits`` and the HF causal-LM loss with
  ``labels = -100`` off model tokens — vs the project's loop (:mod:`spader_pipeline.modeling.warm_start`):
  length-bucketed batches and the output layer only at positions with loss. Reported: real
  (non-padding) tokens per second.
* **RL log-probs** (no grad): full logits + ``log_softmax`` over the whole sequence, then gather, vs
  :func:`spader_pipeline.native.trainer.response_logprobs` (output layer only at model tokens).
  Results must agree.

bf16 autocast is not timed here: on CPUs without native bf16 (AVX2-only, like the 2-core CI
machine) it is many times slower than fp32, so the project enables it on CUDA only.
Medians over the repeats; the machine is shared, so compare the ratio, not absolute numbers.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np
import torch


def _model():
    from spader_pipeline.modeling import TinyQwen3Spec, build_tiny_qwen3

    class _Vocab:  # the embedded default's 8k byte-level BPE, without training one
        eos_token_id, pad_token_id = 2, 0

        def __len__(self) -> int:
            return 8192

    return build_tiny_qwen3(_Vocab(), TinyQwen3Spec())


def _examples(n: int, vocab: int, seed: int = 0):
    from spader_pipeline.modeling.warm_start import SFTExample

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(350, 650)
        mask = [0] * length
        for start in (120, length // 2, length - 30):  # three model turns of ~20 tokens
            for i in range(start, min(length, start + 20)):
                mask[i] = 1
        out.append(SFTExample(tuple(rng.randrange(vocab) for _ in range(length)), tuple(mask)))
    return out


def naive_sft_step(model, batch) -> int:
    from spader_pipeline.modeling.warm_start import collate

    ids, attn, loss_mask = collate(batch, 0)
    labels = ids.masked_fill(loss_mask == 0, -100)
    loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
    loss.backward()
    return int(attn.sum())


def fast_sft_step(model, batch) -> int:
    from spader_pipeline.modeling.warm_start import collate, masked_lm_loss

    ids, attn, loss_mask = collate(batch, 0)
    loss, _ = masked_lm_loss(model, ids, attn, loss_mask)
    loss.backward()
    return int(attn.sum())


def bench_sft(model, examples, repeats: int, batch_tokens: int) -> dict[str, float]:
    from spader_pipeline.modeling.warm_start import length_buckets

    per = max(1, batch_tokens // 650)
    rng = random.Random(1)
    naive_batches = [examples[i : i + per] for i in range(0, len(examples), per)]
    fast_batches = [[examples[i] for i in b] for b in length_buckets(examples, batch_tokens, rng)]
    results = {}
    for name, step, batches in (("naive", naive_sft_step, naive_batches), ("project", fast_sft_step, fast_batches)):
        rates = []
        for _ in range(repeats):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            tokens = sum(step(model, b) for b in batches)
            rates.append(tokens / (time.perf_counter() - t0))
        results[name] = statistics.median(rates)
    return results


def bench_logprobs(model, examples, repeats: int) -> dict[str, float]:
    from spader_pipeline.native.batch import RolloutBatch
    from spader_pipeline.native.trainer import response_logprobs

    batch_examples = examples[:16]
    prompt = 100
    width = max(len(e.input_ids) for e in batch_examples)
    ids = torch.zeros((len(batch_examples), width), dtype=torch.long)
    attn = torch.zeros_like(ids)
    mask = torch.zeros((len(batch_examples), width - prompt))
    for i, e in enumerate(batch_examples):
        ids[i, : len(e.input_ids)] = torch.tensor(e.input_ids)
        attn[i, : len(e.input_ids)] = 1
        mask[i, : len(e.input_ids) - prompt] = torch.tensor(e.loss_mask[prompt:], dtype=torch.float32)
    batch = RolloutBatch(ids, attn, torch.full((len(batch_examples),), prompt), ids[:, prompt:], mask,
                         np.array(["u"] * len(batch_examples), dtype=object), [], *([torch.zeros(1)] * 4),
                         torch.zeros(1, 1, 1, dtype=torch.bool), torch.zeros(1), torch.zeros(1, 1), [], [],
                         torch.zeros(1), torch.zeros(1))

    def naive():
        logits = model(input_ids=ids, attention_mask=attn).logits[:, prompt - 1 : -1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(2, ids[:, prompt:].unsqueeze(-1)).squeeze(-1)
        return logp * mask

    def project():
        return response_logprobs(model, batch, slice(0, len(batch_examples)), temperature=1.0, bf16=False,
                                 with_entropy=False)[0]

    out = {}
    with torch.no_grad():
        assert torch.allclose(naive(), project(), atol=1e-4)
        for name, fn in (("naive", naive), ("project", project)):
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            out[name] = float(attn.sum()) / statistics.median(times)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--examples", type=int, default=48)
    parser.add_argument("--batch-tokens", type=int, default=6000)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = _model()
    examples = _examples(args.examples, model.config.vocab_size)
    sft = bench_sft(model, examples, args.repeats, args.batch_tokens)
    print(f"warm-start SFT step  naive {sft['naive']:8.0f} tok/s   project {sft['project']:8.0f} tok/s   "
          f"ratio {sft['project'] / sft['naive']:.2f}x")
    lp = bench_logprobs(model, examples, args.repeats)
    print(f"RL log-prob pass     naive {lp['naive']:8.0f} tok/s   project {lp['project']:8.0f} tok/s   "
          f"ratio {lp['project'] / lp['naive']:.2f}x")


if __name__ == "__main__":
    main()
