"""Where a native run's memory grows: per step, the process's RSS beside Python's own heap
(tracemalloc), the count of live objects and the bytes of every live torch tensor; at the end the
allocations that grew most between step 5 and the last (docs/results.md, "Memory of a 40-step native run").

    PYTHONPATH=src .venv/bin/python scripts/probe_native_memory.py STEPS bound|keep [BUNDLE]

BUNDLE: a portable bundle (default .gpu/tiny: `python -m spader_pipeline.portable export --env test
--out .gpu/tiny --prepare`); ``bound``: the heap bound of spader_pipeline.host_memory, as the trainer runs.
"""
import collections
import gc
import sys
import tempfile
import tracemalloc
from pathlib import Path

import pandas as pd
import torch

from spader_pipeline.data.formats import samples_from_verl
from spader_pipeline.host_memory import bound_heap
from spader_pipeline.native import NativeTrainerConfig, train_native
from spader_pipeline.portable.bundle import read_settings
from spader_pipeline.retrieval.settings import search_backend
from spader_pipeline.typed_config import method_settings

STEPS, HEAP = int(sys.argv[1]), sys.argv[2]
BUNDLE = Path(sys.argv[3] if len(sys.argv) > 3 else ".gpu/tiny")


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS"))


def main() -> None:
    torch.set_num_threads(1)
    if HEAP == "bound":
        bound_heap()
    settings = read_settings(BUNDLE)
    values = {**method_settings(settings["training"], settings["methods"]["spader"], "native"),
              "total_steps": STEPS, "checkpoint_every": 1000, "log_samples_every": 0, "prompts_per_step": 2,
              "group_size": 4, "micro_batch_size": 8, "device": "cpu"}
    config = NativeTrainerConfig.from_mapping(values)
    train = samples_from_verl(pd.read_parquet(BUNDLE / "train.parquet"))
    tracemalloc.start(10)
    snapshots = {}

    def log(metrics, step):
        gc.collect()
        objects = gc.get_objects()
        tensors = [o for o in objects if isinstance(o, torch.Tensor)]
        tensor_bytes = sum(t.numel() * t.element_size() for t in tensors if not t.is_meta)
        print(f"step {step}: rss {rss_mb():.0f} MB, {len(objects)} objects, {len(tensors)} tensors "
              f"({tensor_bytes / 2**20:.0f} MB), Python heap {tracemalloc.get_traced_memory()[0] / 2**20:.1f} MB",
              flush=True)
        if step in (5, STEPS):
            snapshots[step] = (tracemalloc.take_snapshot(), collections.Counter(type(o).__name__ for o in objects))

    with search_backend({"mode": "local"}, str(BUNDLE / "index"), where="probe") as search:
        train_native(config, model_path=str(BUNDLE / "base_model"), run_dir=Path(tempfile.mkdtemp()),
                     prompt_template=settings["prompt_template"], search=search, samples=train, log_metrics=log)
    (early, early_types), (late, late_types) = snapshots[5], snapshots[STEPS]
    for stat in late.compare_to(early, "traceback")[:6]:
        print(stat)
        print("\n".join(stat.traceback.format()[-6:]))
    print("object types that grew:", (late_types - early_types).most_common(15))


if __name__ == "__main__":
    main()
