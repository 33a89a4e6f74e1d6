"""Command line of the native trainer, outside Kedro (scripts, clusters, crash/resume tests).

    python -m spader_pipeline.native --spec run.json

``run.json``::

    {"config": {...NativeTrainerConfig fields...},   # checked as training.native is (native.config.trainer_config)
     "model_path": "data/06_models/warm_start",
     "samples": "questions.jsonl",          # lines {"id", "question", "ground_truth"}
     "index_dir": "data/06_models/retrieval/bm25",   # or "search_url": "http://127.0.0.1:8000"
     "run_dir": "data/06_models/train_spader",
     "prompt_template": "... {question} ..."}

Re-running the same command after a crash resumes from the latest checkpoint (``config.resume``).
The result (steps, resumed_from, final model) is printed as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from spader_pipeline.native.config import trainer_config
from spader_pipeline.native.trainer import train_native
from spader_pipeline.retrieval.settings import search_backend


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spader_pipeline.native", description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", required=True, help="JSON file describing the run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = json.loads(Path(args.spec).read_text())
    config = trainer_config(spec["config"], where="run.json config")
    samples = [json.loads(line) for line in Path(spec["samples"]).read_text().splitlines() if line.strip()]
    search_params = {"url": spec["search_url"]} if spec.get("search_url") else {"mode": "local"}
    with search_backend(search_params, spec.get("index_dir", ""), where="run.json search") as search:
        result = train_native(
            config,
            model_path=spec["model_path"],
            samples=samples,
            search=search,
            run_dir=spec["run_dir"],
            prompt_template=spec.get("prompt_template") or "Question: {question}",
        )
    sys.stdout.write(json.dumps({"steps": result.steps, "resumed_from": result.resumed_from,
                                 "final_model_dir": str(result.final_model_dir)}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
