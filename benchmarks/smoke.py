"""The benchmarks' ``--smoke`` flag, and the small inputs some of them build under it.

``--smoke`` runs a benchmark at a size that takes seconds (one repeat, tiny shapes) and asserts
nothing about speed; ``make bench-smoke`` runs every benchmark so, one after another, and CI runs it
after the tests: a refactor that breaks a benchmark fails CI. The checks a benchmark makes of its
results (two implementations agreeing) still run.

Benchmarks that read a default run's outputs (a model folder, the index, the VERL parquet) take, under
``--smoke``, what this module builds instead: a tiny Qwen3 (a tokenizer trained on a few hundred of
the embedded Wikipedia passages), a BM25 index of those passages, and training questions about them.
They are built once per ``make bench-smoke`` in ``$BENCH_SMOKE_DIR`` (a fresh folder the target
makes), else in a temporary folder of the process.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HELP = "seconds: a tiny size, one repeat, nothing asserted about speed (make bench-smoke; CI)"


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None = None, **sizes: Any) -> argparse.Namespace:
    """``parser``'s arguments with ``--smoke`` added; under it ``sizes`` replace the defaults (an
    argument given on the command line still wins)."""
    parser.add_argument("--smoke", action="store_true", help=HELP)
    args = parser.parse_args(argv)
    if args.smoke and sizes:
        parser.set_defaults(**sizes)
        args = parser.parse_args(argv)
    return args


@functools.lru_cache(maxsize=1)
def workdir() -> Path:
    """``$BENCH_SMOKE_DIR`` (shared by the benchmarks of one ``make bench-smoke``), else a temporary
    folder removed when the process ends (and set as ``$BENCH_SMOKE_DIR`` for its child processes)."""
    if os.environ.get("BENCH_SMOKE_DIR"):
        path = Path(os.environ["BENCH_SMOKE_DIR"])
        path.mkdir(parents=True, exist_ok=True)
        return path
    path = Path(tempfile.mkdtemp(prefix="bench_smoke_"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.environ["BENCH_SMOKE_DIR"] = str(path)
    return path


def _built(name: str, build) -> Path:
    """``workdir()/name``, made by ``build(folder)`` into a sibling first (a build that fails halfway
    leaves nothing a later benchmark would take for done)."""
    out = workdir() / name
    if not out.exists():
        partial = Path(tempfile.mkdtemp(prefix=f".{name}_", dir=workdir()))
        build(partial)
        partial.rename(out)
    return out


@functools.lru_cache(maxsize=1)
def passages(articles: int = 120) -> list[dict[str, str]]:
    """The passages (``{id, title, contents}``) of the first ``articles`` embedded Wikipedia articles."""
    from spader_pipeline.data.wiki import iter_passages, load_wiki_articles

    return list(iter_passages(load_wiki_articles(limit=articles)))


def model_dir() -> Path:
    """A tiny Qwen3 folder (2 blocks, 2k vocabulary): loads with ``load_model_and_tokenizer``."""
    from spader_pipeline.modeling import TinyQwen3Spec, build_base_model

    texts = [f"{p['title']}\n{p['contents']}" for p in passages()]
    spec = TinyQwen3Spec(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         intermediate_size=128)
    return _built("tiny_model", lambda out: build_base_model(texts, out, spec=spec, vocab_size=2048))


def index_dir() -> Path:
    """A BM25 index of :func:`passages` (``load_retriever``, ``search_backend``)."""
    from spader_pipeline.retrieval import build_index
    from spader_pipeline.retrieval.corpus import iter_records

    return _built("bm25", lambda out: build_index(iter_records(passages()), out, "bm25", show_progress=False))


def index_manifest() -> dict[str, Any]:
    """The index's manifest as ``index_build`` records it (``index_dir`` included)."""
    from spader_pipeline.retrieval.index import read_manifest

    return {**read_manifest(index_dir()), "index_dir": str(index_dir())}


def questions(n: int = 8) -> list[dict[str, Any]]:
    """``n`` training questions about the passages' articles (``id``, ``question``, ``ground_truth``,
    ``data_source``), as ``samples_from_verl`` returns them."""
    titles = list(dict.fromkeys(p["title"] for p in passages()))
    return [{"id": f"smoke_{i}", "question": f"Which article of the index is titled {title}?",
             "ground_truth": [[title]], "data_source": "smoke"} for i, title in enumerate(titles[:n])]


def verl_frame(n: int = 8):
    """:func:`questions` as the VERL training parquet's rows (``data_prep``'s ``verl_rows``)."""
    import pandas as pd

    from spader_pipeline.data.formats import verl_rows

    qa = pd.DataFrame([{**q, "split": "train"} for q in questions(n)])
    return verl_rows(qa, "train", prompt_template(), "spader_search")


def trainer_settings(settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """Native trainer settings at a tiny size: ``settings`` (default: conf/base's GRPO run, 2 questions
    x 2 trajectories) with two turns of 8 tokens, the top block trained, on the CPU."""
    if settings is None:
        import yaml

        from spader_pipeline.typed_config import method_settings

        params = yaml.safe_load((ROOT / "conf/base/parameters_training.yml").read_text())
        settings = {**method_settings(params["training"], params["train_grpo"]["method"], "native"),
                    "method": "grpo", "prompts_per_step": 2, "group_size": 2}
    rollout = {**settings["rollout"], "max_turns": 2, "max_response_tokens": 64}
    return {**settings, "rollout": rollout, "max_new_tokens": 8, "trainable_layers": 1, "device": "cpu",
            "micro_batch_size": settings["prompts_per_step"] * settings["group_size"]}


def prompt_template() -> str:
    """conf/base's prompt template, resolved."""
    import yaml

    from spader_pipeline.agent.prompts import resolve_template

    return resolve_template(yaml.safe_load((ROOT / "conf/base/parameters.yml").read_text())["prompt"])

