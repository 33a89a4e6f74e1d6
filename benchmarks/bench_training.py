"""Training hot paths: the warm-start SFT step, the RL log-probability pass, and a whole RL step.

    .venv/bin/python benchmarks/bench_training.py [--repeats 5] [--examples 64] [--threads 1]
    .venv/bin/python benchmarks/bench_training.py --rl-step [--rl-steps 3] [--models smollm2,tiny]
    .venv/bin/python benchmarks/bench_training.py --update-breakdown [--repeats 3] [--models smollm2]
    .venv/bin/python benchmarks/bench_training.py --smoke    (all three parts at a tiny size: make bench-smoke)

Both on the tiny Qwen3 (hidden 256, 4 layers, 8k vocabulary) or, with ``--model-dir``, a Hugging
Face folder such as the warm-started SmolLM2 (top ``--trainable-layers`` blocks trained), on
sequences shaped like warm-start demonstrations (~350–650 tokens, ~10% model tokens, all starting
with the same 144-token instruction, as every real prompt does). Each also runs *unshared*: the
project's path with the instruction encoded for every row (before :mod:`spader_pipeline.modeling.shared_prefix`).

* **SFT step** (forward + backward on ``batch_tokens`` padded tokens): the straightforward loop —
  random batches of fixed size, full ``model(...).logits`` and the HF causal-LM loss with
  ``labels = -100`` off model tokens — vs the project's loop (:mod:`spader_pipeline.modeling.warm_start`):
  length-bucketed batches and the output layer only at positions with loss. Reported: real
  (non-padding) tokens per second.
* **RL log-probs** (no grad): full logits + ``log_softmax`` over the whole sequence, then gather, vs
  :func:`spader_pipeline.native.update.response_logprobs` (output layer only at model tokens).
  Results must agree.

* **RL step** (``--rl-step``; needs the default run's data, index and models under ``--data``):
  seconds per GRPO step of 4 prompts × 8 trajectories with the native trainer, for SmolLM2 (the
  warm start if present, else the base model) and the tiny model, in configurations of the same
  trainer (``--configs``): *straightforward* — the trainer as it was before issue 10 (every
  parameter trained, a reference-model pass for the KL term, whole passages in observations) —,
  *project* (``training.native`` + ``training.rollout`` of conf/base/parameters_training.yml at 4
  prompts × 8: top 8 blocks trained from the rollout's boundary states, no reference pass at
  ``kl_coef: 0``, passages cut to 120 characters, bf16 by probe) and *recompute* (*project* with
  ``reuse_rollout_states: false``: the update runs the frozen blocks again) and *one-prefill*
  (*project* with each continued turn's prefill as one forward padded to the longest row instead
  of blocks of similar rows; the same trajectories, so the two time the same work). Per step: rollout
  (of which copying the boundary states out of the cache) and update seconds, and whether the
  update started from the rollout's states; then the medians over the steps.
* **Update breakdown** (``--update-breakdown``; same data): one rollout batch of the *project*
  settings (SmolLM2 from the warm start; the tiny model trains its top 2 of 4 blocks), rolled out
  with and without state capture (same seeds: the same tokens, printed), then on that batch
  today's update (the frozen blocks run again) and the new one (from the rollout's boundary
  states, :mod:`spader_pipeline.modeling.boundary`), each split into frozen forward (forward hooks
  from the embeddings to the last frozen block), trained forward/backward (the rest) and
  optimiser step; medians of ``--repeats``, every repeat from the same weights and optimiser
  state. Printed: the parts, both policy losses, the update ratio and the step ratio (rollout +
  update, today's without capture).

bf16 autocast is not timed here: on CPUs without native bf16 (AVX2-only, like the 2-core CI
machine) it is many times slower than fp32; ``bf16: auto`` probes it
(:mod:`spader_pipeline.modeling.precision`). Medians over the repeats; the machine is shared, so
compare the ratio, not absolute numbers (the load average is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import smoke
import torch


def _model():
    from spader_pipeline.modeling import TinyQwen3Spec, build_tiny_qwen3

    class _Vocab:  # the embedded default's 8k byte-level BPE, without training one
        eos_token_id, pad_token_id = 2, 0

        def __len__(self) -> int:
            return 8192

    return build_tiny_qwen3(_Vocab(), TinyQwen3Spec())


INSTRUCTION_TOKENS = 144  # the prompt template's instruction, shared by every real demonstration


def _examples(n: int, vocab: int, seed: int = 0):
    from spader_pipeline.modeling.warm_start import SFTExample

    rng = random.Random(seed)
    instruction = tuple(rng.randrange(vocab) for _ in range(INSTRUCTION_TOKENS))
    out = []
    for _ in range(n):
        length = rng.randint(350, 650)
        mask = [0] * length
        for start in (170, length // 2, length - 30):  # three model turns of ~20 tokens
            for i in range(start, min(length, start + 20)):
                mask[i] = 1
        ids = instruction + tuple(rng.randrange(vocab) for _ in range(length - INSTRUCTION_TOKENS))
        out.append(SFTExample(ids, tuple(mask)))
    return out


def naive_sft_step(model, batch) -> int:
    from spader_pipeline.modeling.warm_start import collate

    ids, attn, loss_mask = collate(batch, 0)
    labels = ids.masked_fill(loss_mask == 0, -100)
    loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
    loss.backward()
    return int(attn.sum())


def unshared_sft_step(model, batch) -> int:
    """The project's loss before the shared instruction: one plain forward over every row."""
    import torch.nn.functional as F

    from spader_pipeline.modeling.warm_start import collate

    ids, attn, loss_mask = collate(batch, 0)
    hidden = model.base_model(input_ids=ids, attention_mask=attn).last_hidden_state
    select = loss_mask[:, 1:].bool()
    loss = F.cross_entropy(model.lm_head(hidden[:, :-1][select]).float(), ids[:, 1:][select])
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
    for name, step, batches in (("naive", naive_sft_step, naive_batches),
                                ("unshared", unshared_sft_step, fast_batches),
                                ("project", fast_sft_step, fast_batches)):
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
    from spader_pipeline.native.update import response_logprobs

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
    import dataclasses

    rows = len(batch_examples)
    real = {"input_ids": ids, "attention_mask": attn, "prompt_lengths": torch.full((rows,), prompt),
            "response_ids": ids[:, prompt:], "response_mask": mask}  # what response_logprobs reads
    batch = RolloutBatch(**{f.name: real.get(f.name, torch.zeros(1)) for f in dataclasses.fields(RolloutBatch)
                            if f.default is dataclasses.MISSING})  # no boundary states: the whole decoder runs

    def naive():
        logits = model(input_ids=ids, attention_mask=attn).logits[:, prompt - 1 : -1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(2, ids[:, prompt:].unsqueeze(-1)).squeeze(-1)
        return logp * mask

    def project():
        return response_logprobs(model, batch, slice(0, len(batch_examples)), temperature=1.0, bf16=False,
                                 with_entropy=False)[0]

    def unshared():  # the output layer only at model tokens, the instruction encoded per row
        hidden = model.base_model(input_ids=ids, attention_mask=attn).last_hidden_state[:, prompt - 1 : -1]
        logp = torch.log_softmax(model.lm_head(hidden[mask.bool()]).float(), dim=-1)
        out = torch.zeros_like(mask)
        out[mask.bool()] = logp.gather(1, ids[:, prompt:][mask.bool()].unsqueeze(1)).squeeze(1)
        return out

    out = {}
    with torch.no_grad():
        assert torch.allclose(naive(), project(), atol=1e-4)
        assert torch.allclose(unshared(), project(), atol=1e-4)
        for name, fn in (("naive", naive), ("unshared", unshared), ("project", project)):
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            out[name] = float(attn.sum()) / statistics.median(times)
    return out


def _project_settings(conf_dir: Path, prompts_per_step: int = 4, group_size: int = 8) -> dict:
    """The GRPO run's native settings from conf/base (as the train_grpo node merges them)."""
    import yaml

    from spader_pipeline.typed_config import method_settings

    params = yaml.safe_load((conf_dir / "parameters_training.yml").read_text())
    settings = method_settings(params["training"], params["train_grpo"]["method"], "native")
    return {**settings, "prompts_per_step": prompts_per_step, "group_size": group_size}  # the benchmarked step shape


def _straightforward_settings(project: dict) -> dict:
    """The trainer as it was before issue 10: everything trained, KL to a reference, whole passages."""
    rollout = {**project["rollout"], "max_observation_chars": 2400, "max_response_tokens": 1536,
               "max_document_chars": None}
    return {**project, "trainable_layers": None, "kl_coef": 0.001, "rollout": rollout, "max_prompt_tokens": 1024}


def _tiny_model_dir(data: Path, out: Path) -> Path:
    from spader_pipeline.modeling import TinyQwen3Spec, build_base_model

    if (out / "config.json").is_file():
        return out
    rows = [json.loads(line) for line in (data / "03_primary/corpus.jsonl").read_text().splitlines()[:3000]]
    return build_base_model((f"{r['title']}\n{r['contents']}" for r in rows), out, spec=TinyQwen3Spec())


def _smoke_rl_inputs(args) -> dict:
    """``--smoke``: what :func:`_rl_inputs` gives, from the smoke inputs (benchmarks/smoke.py: a tiny
    model, a small index, a few questions) and the project's settings at a tiny size."""
    import smoke

    project = smoke.trainer_settings(_project_settings(Path(args.conf), args.prompts_per_step, args.group_size))
    return {"project": project, "samples": smoke.questions(args.prompts_per_step), "index": str(smoke.index_dir()),
            "template": smoke.prompt_template(), "models": {"tiny": smoke.model_dir}}


def _rl_inputs(args) -> dict | None:
    """What an RL step needs from the default run under ``--data``: the project's settings, training
    questions, index, prompt template and model folders (``None``, with a message, when missing)."""
    if args.smoke:
        return _smoke_rl_inputs(args)
    import pandas as pd

    from spader_pipeline.agent.prompts import resolve_template
    from spader_pipeline.data.formats import samples_from_verl

    data = Path(args.data)
    if not (data / "05_model_input/verl/train.parquet").is_file():
        print(f"--rl-step/--update-breakdown need the default run's data under {data}: run `kedro run --pipeline "
              "data_prep` and `--pipeline index_build` (and base_model, warm_start) first")
        return None
    manifest = data / "06_models/retrieval/index_manifest.json"
    if manifest.is_dir():  # a versioned dataset: the newest version
        manifest = sorted(manifest.glob("*/index_manifest.json"))[-1]
    index = json.loads(manifest.read_text())["index_dir"]
    if not Path(index).is_absolute():  # relative to the project root holding --data (data/, data/compare/…)
        index = str(next((root / index for root in data.resolve().parents if (root / index).is_dir()), index))
    warm = data / "06_models/warm_start"
    smollm2 = warm if (warm / "config.json").is_file() else data / "06_models/base_model"
    return {
        "project": _project_settings(Path(args.conf), args.prompts_per_step, args.group_size),
        "samples": samples_from_verl(pd.read_parquet(data / "05_model_input/verl/train.parquet"), None, 0),
        "index": index,
        "template": resolve_template(yaml_prompt(Path(args.conf))),
        "models": {"smollm2": lambda: smollm2,
                   "tiny": lambda: _tiny_model_dir(data, Path(tempfile.gettempdir()) / "bench_tiny_model")},
    }


class _RolloutWork:
    """The rollout's matrix-product work, counted while installed: a forward pre-hook on the decoder
    body, active only while a :class:`~spader_pipeline.agent.decode_engine.DecodeEngine` (``HFGenerator``'s
    ``engine``) generates, counts the positions it runs (a call of one position per row is a decoding
    step, anything longer a prefill). Useful FLOPs = real (unmasked)
    positions x 2 x the body's linear weights + sampled tokens x 2 x the output layer's; padded
    prefill positions are computed but not counted as work (``prefill_computed`` counts them), nor
    are attention scores, so the share of peak it gives is a lower bound.

    ``prefill_blocks=False``: every engine's continued prefill runs as one forward
    (``prefill_block_cost = None``), the code before blocks (same trajectories: each row's random
    draws follow the row, not the layout)."""

    def __init__(self, prefill_blocks: bool = True) -> None:
        self.prefill_blocks = prefill_blocks

    def __enter__(self) -> _RolloutWork:
        from spader_pipeline.agent.decode_engine import DecodeEngine

        self.prefill = self.prefill_computed = self.decode = self.flops = 0
        self._handles: list = []
        self._bodies: set[int] = set()
        self._active = False
        self._original = original = DecodeEngine.generate
        work = self

        def generate(engine, states):
            body = engine.model.base_model
            if id(body) not in work._bodies:
                work._bodies.add(id(body))
                work._handles.append(body.register_forward_pre_hook(work._counter(engine.model), with_kwargs=True))
            if not work.prefill_blocks:
                engine.prefill_block_cost = None
            work._active = True
            try:
                return original(engine, states)
            finally:
                work._active = False

        DecodeEngine.generate = generate
        return self

    def _counter(self, model):
        head = model.get_output_embeddings().weight.numel()
        body = sum(m.weight.numel() for m in model.base_model.modules() if isinstance(m, torch.nn.Linear))

        def count(_module, args, kwargs):
            ids = kwargs.get("input_ids", args[0] if args else None)
            if not self._active or ids is None:
                return
            rows, width = ids.shape
            if width == 1:
                self.decode += rows
                self.flops += rows * 2 * (body + head)
            else:
                mask = kwargs.get("attention_mask")
                real = rows * width if mask is None else int(mask[:, -width:].sum())
                self.prefill += real
                self.prefill_computed += rows * width
                self.flops += real * 2 * body
        return count

    def __exit__(self, *exc) -> None:
        from spader_pipeline.agent.decode_engine import DecodeEngine

        DecodeEngine.generate = self._original
        for handle in self._handles:
            handle.remove()


def bench_rl_step(args) -> None:
    from bench_agent_rollout import matmul_peak_flops

    from spader_pipeline.modeling.device import resolve_device
    from spader_pipeline.modeling.precision import resolve_bf16
    from spader_pipeline.native import NativeTrainerConfig, train_native
    from spader_pipeline.retrieval import load_retriever
    from spader_pipeline.retrieval.service import LocalSearch

    inputs = _rl_inputs(args)
    if inputs is None:
        return
    project = inputs["project"]
    configs = {"straightforward": _straightforward_settings(project), "project": project,
               "recompute": {**project, "reuse_rollout_states": False}, "one-prefill": project}
    for name in args.models.split(","):
        path = inputs["models"][name]()
        for label in args.configs.split(","):
            config = NativeTrainerConfig.from_mapping({
                **configs[label], "method": "grpo", "total_steps": args.rl_steps, "max_seconds": None,
                "resume": False, "checkpoint_every": 0, "log_samples_every": 0, "seed": 0})
            load = os.getloadavg()[0]
            # the rollout's matrix products run in the precision the trainer resolves (bf16 autocast
            # where the CPU has bf16 instructions), so its share is of that precision's peak
            bf16 = resolve_bf16(config.bf16, resolve_device(config.device))
            size, repeats = (256, 1) if args.smoke else (2048, 30)
            peak = matmul_peak_flops(size, repeats, dtype=torch.bfloat16 if bf16 else torch.float32)
            fp32_peak = matmul_peak_flops(size, repeats) if bf16 else peak
            with tempfile.TemporaryDirectory() as run_dir, _RolloutWork(prefill_blocks=label != "one-prefill") as work:
                result = train_native(config, model_path=path, samples=inputs["samples"],
                                      search=LocalSearch(load_retriever(inputs["index"])), run_dir=run_dir,
                                      prompt_template=inputs["template"])
            hist = result.history
            rollout_seconds = sum(h["perf/rollout_seconds"] for h in hist)
            print(f"  rollout work: {work.prefill} prefill ({work.prefill_computed} computed, padding included) + "
                  f"{work.decode} decoding positions, "
                  f"{work.flops / 1e12:.2f} TFLOP in {rollout_seconds:.1f} s = {work.flops / rollout_seconds / 1e9:.0f} "
                  f"GFLOP/s, {100 * work.flops / rollout_seconds / peak:.0f}% of the measured matmul peak "
                  f"({peak / 1e9:.0f} GFLOP/s, torch.mm {size}² {'bf16' if bf16 else 'fp32'} on "
                  f"{torch.get_num_threads()} threads; fp32 {fp32_peak / 1e9:.0f} GFLOP/s)", flush=True)
            for h in hist:
                print(f"  step {h['step']}: rollout {h['perf/rollout_seconds']:.1f} s (state capture "
                      f"{h['perf/capture_seconds']:.2f} s), update {h['perf/update_seconds']:.1f} s, update from "
                      f"rollout states: {'yes' if h['perf/reused_rollout_states'] else 'no'}", flush=True)
            med = {k: statistics.median(h[k] for h in hist)
                   for k in ("perf/step_seconds", "perf/rollout_seconds", "perf/update_seconds")}
            tokens = statistics.median(h["rollout/response_tokens"] for h in hist)
            rows = config.prompts_per_step * config.group_size
            print(f"RL step {name:8s} {label:15s} {config.prompts_per_step} x {config.group_size}: "
                  f"{med['perf/step_seconds']:7.1f} s/step, {med['perf/step_seconds'] / rows:.2f} s/trajectory (rollout "
                  f"{med['perf/rollout_seconds']:.1f} s, update {med['perf/update_seconds']:.1f} s; "
                  f"{tokens:.0f} response tokens/trajectory; median of {len(hist)} steps; load {load:.1f} "
                  f"→ {os.getloadavg()[0]:.1f})", flush=True)


class _PhaseTimer:
    """Seconds spent in the frozen blocks (embeddings up to the last frozen block's output, measured
    with forward hooks) and in the optimiser step, while installed."""

    def __init__(self, model, optimizer, first_block: int) -> None:
        self.frozen = self.optimiser = 0.0
        self._started: dict[str, float] = {}
        blocks = model.model.layers
        cuda = next(model.parameters()).is_cuda

        def now() -> float:
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter()

        def begin(name):
            return lambda *_: self._started.__setitem__(name, now())

        def end(name):
            def done(*_):
                spent = now() - self._started.pop(name)
                setattr(self, name, getattr(self, name) + spent)
            return done

        self._handles = [
            model.get_input_embeddings().register_forward_pre_hook(begin("frozen")),
            blocks[first_block - 1].register_forward_hook(end("frozen")),
            optimizer.register_step_pre_hook(begin("optimiser")),
            optimizer.register_step_post_hook(end("optimiser")),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def bench_update_breakdown(args) -> None:
    """One rollout batch of the project's settings, then today's update (the frozen blocks run
    again) and the new one (from the rollout's boundary states) on that same batch."""
    import copy
    import dataclasses

    from spader_pipeline.native import NativeTrainerConfig
    from spader_pipeline.native.trainer import collect_rollouts, score, start_run
    from spader_pipeline.native.update import update_policy
    from spader_pipeline.retrieval import load_retriever
    from spader_pipeline.retrieval.service import LocalSearch

    inputs = _rl_inputs(args)
    if inputs is None:
        return
    for name in args.models.split(","):
        path = inputs["models"][name]()
        settings = dict(inputs["project"])
        if name == "tiny" and not args.smoke:  # 4 blocks: train the top 2 (SmolLM2: the project's 8 of 30)
            settings["trainable_layers"] = 2
        config = NativeTrainerConfig.from_mapping({
            **settings, "method": "grpo", "total_steps": 1, "max_seconds": None, "resume": False,
            "checkpoint_every": 0, "log_samples_every": 0, "seed": 0})
        search = LocalSearch(load_retriever(inputs["index"]))
        load = os.getloadavg()[0]
        with tempfile.TemporaryDirectory() as run_dir:
            run = start_run(config, path, Path(run_dir))
            first = run.boundary_block
            if first is None:
                print(f"update breakdown {name}: no boundary states for this model/config")
                continue
            rollouts = collect_rollouts(run, inputs["samples"], search, inputs["template"], 1)
            block, run.boundary_block = run.boundary_block, None  # today's rollout: nothing captured
            plain = collect_rollouts(run, inputs["samples"], search, inputs["template"], 1)
            run.boundary_block = block
        batch = rollouts.batch
        if batch.boundary is None:
            print(f"update breakdown {name}: the rollout's states were not usable (see the log)")
            continue
        same = torch.equal(plain.batch.input_ids, batch.input_ids)
        adv, _ = score(config, batch, 1)
        batches = {"today": dataclasses.replace(batch, boundary=None, boundary_block=None), "new": batch}
        run.model.train()
        update_policy(run.model, run.reference, run.optimizer, run.trainable, batch, adv, config, run.actor_cfg,
                      bf16=run.bf16, step=1)  # warm-up: optimiser state allocated, then restored each repeat
        params = [p.detach().clone() for p in run.trainable]
        state = copy.deepcopy(run.optimizer.state_dict())
        times: dict[str, dict[str, list[float]]] = {k: {"update": [], "frozen": [], "optimiser": []} for k in batches}
        losses = {}
        for _ in range(args.repeats):
            for label, b in batches.items():
                with torch.no_grad():
                    for p, saved in zip(run.trainable, params, strict=True):
                        p.copy_(saved)
                run.optimizer.load_state_dict(state)
                timer = _PhaseTimer(run.model, run.optimizer, first)
                started = time.perf_counter()
                stats = update_policy(run.model, run.reference, run.optimizer, run.trainable, b, adv, config,
                                      run.actor_cfg, bf16=run.bf16, step=1,
                                      reference_shares_boundary=run.reference_shares_boundary)
                times[label]["update"].append(time.perf_counter() - started)
                timer.remove()
                times[label]["frozen"].append(timer.frozen)
                times[label]["optimiser"].append(timer.optimiser)
                losses[label] = stats.sums["policy"]
        med = {k: {part: statistics.median(v) for part, v in parts.items()} for k, parts in times.items()}
        tokens = int(batch.attention_mask.sum())
        print(f"update breakdown {name}: GRPO {config.prompts_per_step} × {config.group_size}, {tokens} tokens, "
              f"blocks {first}+ trained, median of {args.repeats}; load {load:.1f} → {os.getloadavg()[0]:.1f}")
        print(f"  rollout            {rollouts.seconds:7.2f} s with state capture (copies {rollouts.capture_seconds:.2f} s), "
              f"{plain.seconds:7.2f} s without; same tokens: {same}")
        for label in batches:
            m = med[label]
            trained = m["update"] - m["frozen"] - m["optimiser"]
            print(f"  update {label:5s}       {m['update']:7.2f} s = frozen forward {m['frozen']:.2f} + trained "
                  f"forward/backward {trained:.2f} + optimiser {m['optimiser']:.2f}   (policy loss {losses[label]:.6f})")
        today_step = plain.seconds + med["today"]["update"]
        new_step = rollouts.seconds + med["new"]["update"]
        print(f"  update ratio new/today {med['new']['update'] / med['today']['update']:.2f}; step (rollout + update) "
              f"today {today_step:.1f} s → new {new_step:.1f} s, ratio {new_step / today_step:.2f}", flush=True)


def yaml_prompt(conf_dir: Path) -> dict:
    import yaml

    return yaml.safe_load((conf_dir / "parameters.yml").read_text())["prompt"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--examples", type=int, default=48)
    parser.add_argument("--batch-tokens", type=int, default=6000)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--rl-step", action="store_true", help="time whole GRPO steps (needs --data)")
    parser.add_argument("--rl-steps", type=int, default=3)
    parser.add_argument("--update-breakdown", action="store_true",
                        help="one rollout batch, then today's update vs the one from rollout states (needs --data)")
    parser.add_argument("--models", default="smollm2,tiny")
    parser.add_argument("--configs", default="straightforward,project", help="--rl-step: straightforward, "
                        "project, recompute (the project's settings, the update running the frozen blocks again), "
                        "one-prefill (the project's settings, each turn's prefill as one padded forward)")
    parser.add_argument("--data", default="data")
    parser.add_argument("--conf", default="conf/base",
                        help="a folder with parameters.yml and parameters_training.yml (an environment merged over base)")
    parser.add_argument("--prompts-per-step", type=int, default=4, help="questions per RL step")
    parser.add_argument("--group-size", type=int, default=8, help="trajectories per question")
    parser.add_argument("--model-dir", default=None, help="a HF model folder instead of the tiny model (SFT/log-prob)")
    parser.add_argument("--trainable-layers", type=int, default=8, help="with --model-dir: top blocks trained")
    args = smoke.parse_args(parser, repeats=1, examples=4, batch_tokens=1300, rl_steps=1, models="tiny",
                            configs="straightforward,project,recompute,one-prefill", prompts_per_step=2, group_size=2)
    torch.set_num_threads(args.threads)  # --threads 1 on an oversubscribed machine (2-thread barriers stall)
    if args.smoke:  # every part, at a tiny size
        bench_hot_paths(args)
        bench_rl_step(args)
        bench_update_breakdown(args)
    elif args.rl_step or args.update_breakdown:
        (bench_update_breakdown if args.update_breakdown else bench_rl_step)(args)
    else:
        bench_hot_paths(args)


def bench_hot_paths(args) -> None:
    """The SFT step and the RL log-prob pass."""
    torch.manual_seed(0)
    if args.model_dir:  # e.g. data/06_models/warm_start: SmolLM2, top blocks trained as in the default
        from spader_pipeline.modeling import load_model_and_tokenizer
        from spader_pipeline.modeling.base_model import train_top_layers

        model, _ = load_model_and_tokenizer(args.model_dir)
        train_top_layers(model, args.trainable_layers)
    else:
        model = _model()
    model.train()
    examples = _examples(args.examples, model.config.vocab_size)
    print(f"load {os.getloadavg()[0]:.1f}; {args.examples} sequences of 350-650 tokens sharing a "
          f"{INSTRUCTION_TOKENS}-token instruction; median of {args.repeats}", flush=True)
    for label, bench in (("warm-start SFT step", lambda: bench_sft(model, examples, args.repeats, args.batch_tokens)),
                         ("RL log-prob pass   ", lambda: bench_logprobs(model, examples, args.repeats))):
        r = bench()
        print(f"{label}  naive {r['naive']:7.0f} tok/s   unshared {r['unshared']:7.0f} tok/s   "
              f"project {r['project']:7.0f} tok/s   ratio {r['project'] / r['naive']:.2f}x naive, "
              f"{r['project'] / r['unshared']:.2f}x unshared", flush=True)

if __name__ == "__main__":
    main()
