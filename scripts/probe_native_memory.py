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

torch.set_num_threads(1)
if sys.argv[2] == "bound": bound_heap()
b = Path(sys.argv[3] if len(sys.argv) > 3 else ".gpu/tiny"); s = read_settings(b)
tr = s["training"]; m = s["methods"]["spader"]
vals = {**method_settings(tr, m, "native"), "total_steps": int(sys.argv[1]), "checkpoint_every": 1000, "log_samples_every": 0,
        "prompts_per_step": 2, "group_size": 4, "micro_batch_size": 8, "device": "cpu"}
cfg = NativeTrainerConfig.from_mapping(vals)
train = samples_from_verl(pd.read_parquet(b / "train.parquet"))
tracemalloc.start(10)
snaps = {}
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"): return int(line.split()[1]) / 1024
def log(metrics, step):
    gc.collect()
    tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors if not t.is_meta)
    types = collections.Counter(type(o).__name__ for o in gc.get_objects())
    print(step, f"rss {rss():.0f} MB", "objects", sum(types.values()), "tensors", len(tensors), f"{nbytes/2**20:.0f} MB",
          f"py {tracemalloc.get_traced_memory()[0]/2**20:.1f} MB", flush=True)
    if step in (5, int(sys.argv[1])): snaps[step] = (tracemalloc.take_snapshot(), types)
with search_backend({"mode": "local"}, str(b / "index"), where="probe") as search:
    train_native(cfg, model_path=str(b / "base_model"), run_dir=Path(tempfile.mkdtemp()), prompt_template=s["prompt_template"],
                 search=search, samples=train, log_metrics=log)
a, b2 = snaps[5], snaps[int(sys.argv[1])]
for st in b2[0].compare_to(a[0], "traceback")[:6]:
    print(st); print("\n".join(st.traceback.format()[-6:]))
print((b2[1] - a[1]).most_common(15))
