"""``python -m spader_pipeline.portable export|run``: write a bundle from a Kedro environment, or run one.

Export (here, where Kedro is installed; ``--prepare`` first runs data_prep, index_build and
base_model in that environment)::

    python -m spader_pipeline.portable export --env one_gpu --out .gpu/bundle --prepare

Run (anywhere torch runs; no Kedro, no MLflow)::

    python -m spader_pipeline.portable run --bundle .gpu/bundle --out /tmp/one_gpu --device auto
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import yaml


def export(env: str, out: str, methods: list[str], heldout: str | None, prepare: bool, project: str) -> Path:
    from kedro.framework.session import KedroSession
    from kedro.framework.startup import bootstrap_project

    from spader_pipeline.portable.bundle import export_bundle, run_settings

    bootstrap_project(Path(project).resolve())
    if prepare:
        with KedroSession.create(project_path=project, env=env) as session:
            session.run(pipeline_names=["data_prep", "index_build", "base_model"])
    with KedroSession.create(project_path=project, env=env) as session:
        context = session.load_context()
        params, catalog = context.params, context.catalog
        dataset = heldout or params["compare"]["dataset"]
        eval_sets = catalog.load("eval_sets")
        if dataset not in eval_sets:
            raise SystemExit(f"export: no held-out set {dataset!r} in eval_sets (have {sorted(eval_sets)})")
        settings = run_settings(params, methods, dataset)
        return export_bundle(
            out, settings, verl_train=catalog.load("verl_train"), verl_validation=catalog.load("verl_validation"),
            heldout=eval_sets[dataset](), index_dir=catalog.load("index_manifest")["index_dir"],
            base_model_dir=catalog.load("base_model_manifest")["path"],
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m spader_pipeline.portable", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    exp = commands.add_parser("export", help="write a bundle from a Kedro environment")
    exp.add_argument("--env", required=True)
    exp.add_argument("--out", required=True)
    exp.add_argument("--methods", default="grpo,spader")
    exp.add_argument("--heldout", default=None, help="eval_sets partition (default: compare.dataset)")
    exp.add_argument("--prepare", action="store_true", help="run data_prep, index_build and base_model first")
    exp.add_argument("--project", default=".")
    run = commands.add_parser("run", help="run a bundle: warm start, RL per method, held-out evaluation")
    run.add_argument("--bundle", required=True)
    run.add_argument("--out", required=True)
    run.add_argument("--device", default="auto")
    run.add_argument("--methods", default=None)
    run.add_argument("--rl-seconds", type=float, default=None, help="wall-clock budget of each method's RL run")
    run.add_argument("--max-heldout", type=int, default=None, help="score only the first N held-out questions")
    run.add_argument("--parallel-methods", action="store_true",
                     help="train and evaluate the methods side by side, one process each, on the same device")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a setting, e.g. training.native.total_steps=2 (YAML value; repeatable)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stdout)
    if args.command == "export":
        path = export(args.env, args.out, args.methods.split(","), args.heldout, args.prepare, args.project)
        print(f"bundle written to {path}")  # noqa: T201 - the command's output
        return
    from spader_pipeline.portable.run import run_bundle

    methods = args.methods.split(",") if args.methods else None
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set {item!r}: use KEY=VALUE")
        overrides[key] = yaml.safe_load(value)
    summary = run_bundle(args.bundle, args.out, device=args.device, methods=methods, rl_seconds=args.rl_seconds,
                         overrides=overrides, max_heldout=args.max_heldout, parallel_methods=args.parallel_methods)
    shown = {k: summary[k] for k in ("models", "steps", "failed_methods", "seconds", "environment")}
    print(json.dumps(shown, indent=1, default=float))  # noqa: T201 - the command's output
    if summary["failed_methods"]:
        raise SystemExit(f"failed: {summary['failed_methods']}")


if __name__ == "__main__":
    main()
