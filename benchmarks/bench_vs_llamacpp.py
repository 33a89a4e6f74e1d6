"""Our decoder against llama.cpp on the same weights: prefill and decoding tokens per second on the CPU, or on one GPU (``--device cuda``).

    .venv/bin/python benchmarks/bench_vs_llamacpp.py [--rows 1,4,16,32,64] [--threads 1,2] [--repeats 2]
        [--prompt-tokens 512] [--new-tokens 64] [--model-dir data/06_models/base_model] [--json PATH]
        [--ours-only | --llamacpp-only | --build-only] [--before python|packed|unpacked|autocast|host|none] [--jobs 2]
        [--device cpu|cuda] [--cuda-arch 90] [--cuda-toolkit DIR] [--llamacpp-binary PATH]

Issue 57: how far is the project's decoder (:func:`~spader_pipeline.modeling.decode.decode_batch` over a
:class:`~spader_pipeline.modeling.kv_cache.GrowingKVCache`, what the rollouts run) from a dedicated CPU
inference engine? Both run the same model folder (SmolLM2-135M-Instruct, ``make run``'s base model) at
the same shapes: ``rows`` sequences of ``--prompt-tokens`` random tokens, then ``--new-tokens`` decoding
steps of one token per row, no early stop.

* **llama.cpp**: its ``llama-batched-bench`` (``-npp P -ntg N -npl rows``, ``-b 2048 -ub 512``), built
  from the ``llama-cpp-python`` sdist's llama.cpp tree with ``GGML_NATIVE`` (this CPU's instruction
  set), on a bf16 GGUF converted from the model folder by the tree's ``convert_hf_to_gguf.py``.
  Everything lives under ``build/llamacpp/`` and is made once (the GGUF per content hash of the
  folder); llama.cpp is never a dependency of the project. The converter runs on the project venv's
  torch, transformers and numpy with the tree's ``gguf-py`` first on ``PYTHONPATH``; the one module
  the venv lacks, ``sentencepiece``, is installed into ``build/llamacpp/pydeps`` (not into the venv).
  On a GPU (``--device cuda``) it is built with ``GGML_CUDA`` for the GPU found, or, with ``--cuda-arch 90``,
  for that compute capability on a machine without one (the lent H200's binary is built ahead of its
  lease this way: ``scripts/gpu_wheels.sh``'s ``prebuild_llamacpp_cuda``), then taken with
  ``--llamacpp-binary``.
* **ours**: the model from ``load_model_and_tokenizer``, under bf16 autocast when ``resolve_bf16("auto")``
  turns it on for this CPU (each weight cast once per call, :func:`~spader_pipeline.modeling.precision.
  bf16_inference`, as a rollout turn runs), ``torch.set_num_threads(threads)``; greedy, no
  end-of-sequence id, so every row decodes its whole budget. The prefill's forward yields the first new
  token (llama.cpp's prefill too computes the last prompt position's logits); the decoding phase is the
  ``--new-tokens`` steps after it. Both phases are timed within one call: the prefill ends when the
  prefill's last forward returns (:func:`forward_clock`).

Columns (median over ``--repeats``; the two engines alternate which goes first in each repeat):

* ``prefill tok/s``: rows x prompt tokens / prefill seconds (llama.cpp's ``S_PP t/s``);
* ``decode tok/s (ms/step)``: rows x new tokens / decoding seconds (llama.cpp's ``S_TG t/s``), and the
  milliseconds of one decoding step of all rows (``T_TG s`` / new tokens);
* ``ratio``: ours / llama.cpp, above 1 where ours is faster;
* ``before``: our decoder before a change, in the same run and process, and its ratio to llama.cpp:
  ``--before python`` (the default), every decoding step through the Python step instead of the C++
  one (:mod:`~spader_pipeline.modeling.native_step`), over the same bf16 cache and attention;
  ``--before packed``, every decoding step through the model's forward instead of the
  fused step (:mod:`~spader_pipeline.modeling.decode_step`) and over an fp32 cache instead of a bf16
  one (:mod:`~spader_pipeline.modeling.decode_attention`); ``--before unpacked``, that and autocast's
  own linear layers (each bf16 weight reordered for oneDNN at every call) instead of weights packed once
  (:mod:`~spader_pipeline.modeling.packed_linear`); ``--before autocast``, autocast's own linear layers and
  nothing else changed (without packed weights the fused and C++ steps step aside, so every decoding step runs
  the model's forward, over the same bf16 cache and attention: a CPU whose weights are not packed);
  ``--before host`` (on a GPU), every decoding step
  through the model's forward with the host reading each step's tokens instead of the static step in CUDA
  graphs (:mod:`~spader_pipeline.modeling.graph_decode`); ``--before none`` skips it. Absent where nothing is
  packed (no bf16 unit).

Also printed: the CPU (model name, family/model, whether it has avx512_bf16 and AMX), what
``-march=native`` enables for the compiler that built llama.cpp, torch's version, llama.cpp's settings
(flash attention: what its ``auto`` chose), and the load average before and after (the machine may be shared).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import smoke
import torch

ROOT = Path(__file__).resolve().parents[1]
#: llama.cpp; our decoder; our decoder before the packed weights (autocast reordering each weight per call)
ENGINES = ("llamacpp", "ours", "before")
#: our decoder's variants: (weights packed for oneDNN, decoding steps through the fused step, bf16 KV cache
#: with the native decoding attention, the fused step in C++, the static step's switch: auto, on a GPU)
VARIANTS = {"ours": (True, True, True, True, "auto"), "python": (True, True, True, False, "auto"),
            "packed": (True, False, False, False, "auto"), "unpacked": (False, False, False, False, "auto"),
            "autocast": (False, True, True, True, "auto"), "host": (True, True, True, True, "off")}
LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendor/llama.cpp is built
WORK = ROOT / "build/llamacpp"
SOURCE = WORK / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
TREE = SOURCE / "vendor/llama.cpp"
CMAKE_DIR = WORK / f"cmake-{LLAMA_CPP_PYTHON}"
CUDA_CMAKE_DIR = WORK / f"cmake-{LLAMA_CPP_PYTHON}-cuda"  # the GPU half: GGML_CUDA, every layer offloaded
PYDEPS = WORK / "pydeps"  # the converter's modules missing from the project venv
CONVERTER_EXTRA = ["sentencepiece>=0.1.98,<0.3.0"]


def _run(cmd: list[Any], log: Path | None = None, **kwargs: Any) -> None:
    """Run ``cmd``; with ``log``, its output goes there (appended) and only its tail is shown on failure."""
    print("+", " ".join(str(c) for c in cmd) + (f"  (output: {log.relative_to(ROOT)})" if log else ""), flush=True)
    if log is None:
        subprocess.run([str(c) for c in cmd], check=True, **kwargs)
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a", encoding="utf-8") as out:
        done = subprocess.run([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT, check=False, **kwargs)
    if done.returncode != 0:
        raise SystemExit(f"failed ({done.returncode}); the end of {log}:\n" + "".join(log.read_text().splitlines(True)[-40:]))


# ---- llama.cpp: source, build, model conversion -------------------------------------------------------


def llamacpp_tree() -> Path:
    """The llama.cpp tree of the sdist, downloaded and unpacked under build/llamacpp/ once."""
    if (TREE / "CMakeLists.txt").is_file():
        return TREE
    sdist = WORK / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not sdist.is_file():
        _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
              f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", WORK])
    with tarfile.open(sdist) as archive:
        archive.extractall(WORK, filter="data")
    return TREE


def llama_max_seq() -> int:
    """The most sequences llama.cpp decodes in one batch (``LLAMA_MAX_SEQ`` in its ``src/llama-cparams.h``;
    256 in the pinned tree): ``llama-batched-bench -npl`` above it fails, and a server takes more requests
    in rounds of this many."""
    header = llamacpp_tree() / "src/llama-cparams.h"
    found = re.search(r"#define\s+LLAMA_MAX_SEQ\s+(\d+)", header.read_text(encoding="utf-8"))
    if found is None:
        raise SystemExit(f"no LLAMA_MAX_SEQ in {header}")
    return int(found.group(1))


def build_batched_bench(jobs: int, cuda: bool = False, cuda_arch: str | None = None,
                        cuda_toolkit: Path | None = None) -> Path:
    """``llama-batched-bench`` built for this CPU (``GGML_NATIVE``), or with ``cuda`` for the GPU
    (``GGML_CUDA``: needs the CUDA toolkit's ``nvcc``), once each.

    ``cuda_arch`` (a compute capability, ``"90"`` for an H100/H200) builds for that GPU instead of the one
    found, so the build needs none: llama.cpp's CPU code then for any x86-64 (``GGML_NATIVE`` off), the
    result one binary (static ``ggml``/``llama``; CUDA's runtime and cuBLAS linked dynamically, found where it
    runs). ``cuda_toolkit``: the toolkit's root where ``nvcc`` on PATH is not the one to build with."""
    cmake_dir = (CUDA_CMAKE_DIR.with_name(f"{CUDA_CMAKE_DIR.name}-sm{cuda_arch}") if cuda and cuda_arch
                 else CUDA_CMAKE_DIR if cuda else CMAKE_DIR)
    binary = cmake_dir / "bin/llama-batched-bench"
    if binary.is_file():
        return binary
    nvcc = (cuda_toolkit / "bin/nvcc") if cuda_toolkit else shutil.which("nvcc")
    if cuda and (nvcc is None or not Path(nvcc).is_file()):
        raise SystemExit("llama.cpp's CUDA build needs nvcc (the CUDA toolkit), not found on PATH; "
                         "--ours-only times our decoder alone")
    tree = llamacpp_tree()
    started = time.perf_counter()
    log = WORK / "build.log"
    log.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}  # not make's -w
    target = ["-DGGML_NATIVE=ON"]
    if cuda and cuda_arch:
        target = ["-DGGML_NATIVE=OFF", f"-DCMAKE_CUDA_ARCHITECTURES={cuda_arch}", "-DBUILD_SHARED_LIBS=OFF"]
    if cuda and cuda_toolkit:
        target += [f"-DCMAKE_CUDA_COMPILER={nvcc}", f"-DCUDAToolkit_ROOT={cuda_toolkit}"]
    _run(["cmake", "-S", tree, "-B", cmake_dir, "-DCMAKE_BUILD_TYPE=Release", *target,
          f"-DGGML_CUDA={'ON' if cuda else 'OFF'}", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
          "-DLLAMA_BUILD_TESTS=OFF"], log, env=env)
    _run(["cmake", "--build", cmake_dir, "--config", "Release", "--target", "llama-batched-bench", "-j", jobs],
         log, env=env)
    print(f"built {binary.relative_to(ROOT)} in {time.perf_counter() - started:.0f} s", flush=True)
    return binary


def folder_hash(folder: Path) -> str:
    """Content hash of a model folder: every file's relative path and bytes."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(folder)).encode() + b"\0")
        with path.open("rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()[:16]


def converted_gguf(folder: Path) -> Path:
    """The model folder as a bf16 GGUF (converted once per content hash)."""
    out = WORK / "models" / f"{folder.resolve().name}-{folder_hash(folder)}.bf16.gguf"
    if out.is_file():
        return out
    tree = llamacpp_tree()
    # sentencepiece: imported by the llama converter before it looks for a file; into PYDEPS where this
    # interpreter lacks it (the project venv does; a GPU image may have it)
    if importlib.util.find_spec("sentencepiece") is None and not (PYDEPS / "sentencepiece").is_dir():
        _run([sys.executable, "-m", "pip", "install", "--quiet", "--target", PYDEPS, *CONVERTER_EXTRA])
    inherited = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree / "gguf-py"), str(PYDEPS), *inherited])}
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".partial")
    _run([sys.executable, tree / "convert_hf_to_gguf.py", folder, "--outtype", "bf16", "--outfile", partial],
         WORK / "convert.log", env=env)
    partial.rename(out)
    return out


def _gguf_module() -> Any:
    """``gguf``: the installed package, else the llama.cpp tree's ``gguf-py`` (a bare GPU machine)."""
    if importlib.util.find_spec("gguf") is None:
        sys.path.insert(0, str(llamacpp_tree() / "gguf-py"))
    import gguf

    return gguf


def _interleaved_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """A query or key projection ``[heads * D, in]`` with each head's rows reordered from transformers'
    rotary layout (first half, second half) to GGUF llama's (pairs), as llama.cpp's converter stores them."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def synthetic_gguf(model: Any, path: Path) -> Path:
    """``model`` (a transformers Llama-family ``*ForCausalLM``, its weights whatever they are: random for
    a benchmark of speed) as a bf16 GGUF of llama.cpp's ``llama`` architecture at ``path``, with a
    placeholder vocabulary of its size (an SPM one: ``<unk>``, ``<s>``, ``</s>``, the 256 byte tokens, then
    ``t<i>``; a speed benchmark feeds token ids, never text).

    What a model folder and the tree's converter would give for the same weights (names, the query and key
    rows in GGUF's rotary layout, norms in fp32, no ``output`` where the embeddings are tied), without a
    tokenizer or a model folder: so a bare GPU machine times llama.cpp at our benchmark's shape and weights.
    Tied embeddings only (SmolLM2's); biases, QK norms and rotary scaling are refused."""
    gguf = _gguf_module()
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
    if (not config.tie_word_embeddings or getattr(config, "attention_bias", False) or theta is None
            or rope.get("rope_type", "default") != "default" or getattr(config, "mlp_bias", False)):
        raise ValueError("synthetic_gguf: a Llama with tied embeddings, no biases, plain rotary embedding")
    vocab = config.vocab_size
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    per_block = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
    for block in range(config.num_hidden_layers):
        for ours, theirs in per_block.items():
            names[f"model.layers.{block}.{ours}.weight"] = f"blk.{block}.{theirs}.weight"
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    if set(state) != set(names):
        raise ValueError(f"synthetic_gguf: tensors not of a plain Llama: {sorted(set(state) ^ set(names))[:6]}")
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(theta))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    specials = ["<unk>", "<s>", "</s>"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"t{i}" for i in range(len(tokens), vocab)]
    types = ([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
             + [gguf.TokenType.NORMAL] * (vocab - len(specials) - 256))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens[:vocab])
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types(types[:vocab])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, tensor in state.items():
        tensor = tensor.detach().float().cpu()
        if name.endswith("q_proj.weight"):
            tensor = _interleaved_rotary(tensor, heads)
        elif name.endswith("k_proj.weight"):
            tensor = _interleaved_rotary(tensor, kv_heads)
        if tensor.dim() == 1:  # norms stay fp32, as the converter keeps them
            writer.add_tensor(names[name], tensor.numpy())
        else:
            writer.add_tensor(names[name], tensor.to(torch.bfloat16).view(torch.int16).numpy().view("uint16"),
                              raw_dtype=gguf.GGMLQuantizationType.BF16)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _with_cuda_libraries(environ: Any) -> dict[str, str]:
    """``environ`` with CUDA's libraries on ``LD_LIBRARY_PATH``: those of NVIDIA's wheels beside this
    interpreter's torch (``nvidia/*/lib``) first, then the toolkit's (``/usr/local/cuda/lib64``), so a
    ``llama-batched-bench`` built elsewhere (``--cuda-arch``) finds a cuBLAS and runtime of its major version."""
    spec = importlib.util.find_spec("nvidia")
    bases = (spec.submodule_search_locations or []) if spec else []
    wheels = [str(d) for base in bases for d in sorted(Path(base).glob("*/lib"))]
    paths = [*wheels, "/usr/local/cuda/lib64", *filter(None, environ.get("LD_LIBRARY_PATH", "").split(os.pathsep))]
    return {**environ, "LD_LIBRARY_PATH": os.pathsep.join(dict.fromkeys(paths))}


def run_batched_bench(binary: Path, gguf: Path, rows: list[int], threads: int, prompt: int, new: int,
                      cuda: bool = False) -> dict[str, Any]:
    """One ``llama-batched-bench`` sweep over ``rows``; per row count its prefill/decoding rates
    (``cuda``: every layer on the GPU, ``-ngl 999``). A row count above :func:`llama_max_seq` gets the rates
    of that many sequences, marked ``sequences``: llama.cpp would take such a batch in rounds of them."""
    cap = llama_max_seq()
    sweep = sorted({min(n, cap) for n in rows})
    context = max(sweep) * (prompt + new)  # every sequence its own prompt and tokens (no shared prompt)
    cmd = [binary, *(["-ngl", 999] if cuda else []), "-m", gguf, "-c", context, "-b", 2048, "-ub", 512,
           "-npp", prompt, "-ntg", new,
           "-npl", ",".join(map(str, sweep)), "-t", threads, "-tb", threads, "-lv", 4]  # -lv 4: what auto chose
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, check=False,
                         env=_with_cuda_libraries(os.environ) if cuda else None)
    text = out.stdout + out.stderr
    if out.returncode != 0:
        raise SystemExit(f"llama-batched-bench failed ({out.returncode}):\n{text[-3000:]}")
    parsed = parse_batched_bench(text)
    for n in rows:
        if n > cap:
            parsed["rows"][n] = {**parsed["rows"][cap], "sequences": cap}
    return parsed


def parse_batched_bench(text: str) -> dict[str, Any]:
    """The markdown table of ``llama-batched-bench`` (columns by name) and its settings line."""
    header: list[str] | None = None
    results: dict[int, dict[str, float]] = {}
    for line in text.splitlines():
        if "|" not in line:
            continue
        cells = [c.strip() for c in line[line.index("|"):].strip().strip("|").split("|")]  # any log prefix off
        if "S_PP t/s" in cells:
            header = cells
        elif header and len(cells) == len(header) and cells[0].isdigit():
            row = dict(zip(header, map(float, cells), strict=True))
            results[int(row["B"])] = {"prefill_tps": row["S_PP t/s"], "decode_tps": row["S_TG t/s"],
                                      "prefill_s": row["T_PP s"], "decode_s": row["T_TG s"],
                                      "step_ms": 1e3 * row["T_TG s"] / row["TG"]}
    if not results:
        raise SystemExit(f"no table in llama-batched-bench's output:\n{text[-3000:]}")
    settings = re.search(r"n_kv_max = .*", text)
    flash = re.search(r"Flash Attention (\w+)", text)  # what flash_attn = -1 (auto) resolved to
    return {"rows": results, "settings": (settings.group(0) if settings else "")
            + (f" (flash attention {flash.group(1)})" if flash else "")}


# ---- ours ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def forward_clock(model: Any, sync: Any = None) -> Iterator[list[float]]:
    """While active, the times at which ``model``'s forward calls return (the prefill's forwards come
    first: ``DecodeResult.prefill_blocks`` of them). An instance attribute over ``forward`` (its signature
    kept), not a hook, so the decoding steps run as they do outside the benchmark (the fused step runs
    them without the forward; a hook would make it step aside). ``sync``: called before each time is
    taken (``torch.cuda.synchronize`` on a GPU, whose forward returns before it has run)."""
    returns: list[float] = []
    forward = model.forward

    @functools.wraps(forward)
    def timed(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        if sync is not None:
            sync()
        returns.append(time.perf_counter())
        return out

    model.forward = timed
    try:
        yield returns
    finally:
        del model.forward


def time_ours(model: Any, rows: int, prompt: int, new: int, bf16: bool, pad_id: int,
              generator: torch.Generator) -> dict[str, float]:
    """One ``decode_batch`` call: ``rows`` random prompts, ``new`` forwards after the prefill."""
    from transformers import LogitsProcessorList

    from spader_pipeline.modeling.decode import decode_batch
    from spader_pipeline.modeling.kv_cache import GrowingKVCache
    from spader_pipeline.modeling.precision import bf16_inference

    device = model.device
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    ids = torch.randint(0, model.config.vocab_size, (rows, prompt), generator=generator).to(device)
    mask = torch.ones_like(ids)
    with bf16_inference(model, device.type, bf16), forward_clock(model, sync) as returns:
        if sync is not None:
            sync()
        started = time.perf_counter()
        # budget new + 1: the prefill samples the first token, each of the `new` forwards one more
        result = decode_batch(model, ids, mask, GrowingKVCache(), [new + 1] * rows, eos_ids=set(), pad_id=pad_id,
                              processors=LogitsProcessorList(), do_sample=False)
        if sync is not None:
            sync()
        ended = time.perf_counter()
    assert result.steps == new + 1 and result.row_steps == rows * (new + 1), "a row stopped early"
    prefill_end = returns[result.prefill_blocks - 1]  # a long prefill is several forwards (row chunks)
    prefill_s, decode_s = prefill_end - started, ended - prefill_end
    return {"prefill_tps": rows * prompt / prefill_s, "decode_tps": rows * new / decode_s,
            "prefill_s": prefill_s, "decode_s": decode_s, "step_ms": 1e3 * decode_s / new}


def run_ours(model: Any, rows: list[int], threads: int, prompt: int, new: int, bf16: bool, pad_id: int,
             seed: int, variant: str = "ours") -> dict[str, Any]:
    """``time_ours`` for each row count, our decoder as :data:`VARIANTS` says: ``ours`` as it is;
    ``python``: the decoding steps through the Python step (:mod:`~spader_pipeline.modeling.decode_step`)
    instead of the C++ one (:mod:`~spader_pipeline.modeling.native_step`); ``packed``: weights packed for oneDNN, but every decoding step through the model's forward (no
    :mod:`~spader_pipeline.modeling.decode_step`) over an fp32 cache (no
    :mod:`~spader_pipeline.modeling.decode_attention`); ``unpacked``: that, and autocast's own linear
    layers (no :mod:`~spader_pipeline.modeling.packed_linear`: the reorder at every call); ``autocast``: only
    the packing off (so no fused step either), the bf16 cache and attention kept; ``host`` (a GPU's
    before): every decoding step through the model's forward, the host reading each step's tokens, instead of
    the static step captured in CUDA graphs (:mod:`~spader_pipeline.modeling.graph_decode`)."""
    from spader_pipeline.modeling import (
        decode_attention,
        decode_step,
        native_step,
        packed_linear,
        static_cache,
    )

    (packed_linear.PACK_WEIGHTS, decode_step.FUSED_DECODE_STEP, decode_attention.BF16_CACHE,
     native_step.NATIVE_STEP, static_cache.STATIC_DECODE) = VARIANTS[variant]
    torch.set_num_threads(threads)
    generator = torch.Generator().manual_seed(seed)
    time_ours(model, 1, min(prompt, 32), 2, bf16, pad_id, generator)  # warm-up at this thread count
    if model.device.type == "cuda":  # each shape's graphs captured before it is timed (once per process)
        for n in rows:
            time_ours(model, n, prompt, new, bf16, pad_id, generator)
    return {"rows": {n: time_ours(model, n, prompt, new, bf16, pad_id, generator) for n in rows}}


# ---- the machine and the report ------------------------------------------------------------------------


def cpu_info() -> dict[str, Any]:
    fields: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
        if not line.strip():
            break  # the first processor is enough
    flags = set(fields.get("flags", "").split())
    return {"model_name": fields.get("model name", "?"), "family": fields.get("cpu family", "?"),
            "model": fields.get("model", "?"), "cores": os.cpu_count(), "avx512_bf16": "avx512_bf16" in flags,
            "amx": sorted(f for f in flags if f.startswith("amx")), "avx512f": "avx512f" in flags}


def native_features() -> list[str]:
    """What ``-march=native`` turns on for the C compiler of the llama.cpp build (its macros)."""
    cache = CMAKE_DIR / "CMakeCache.txt"
    compiler = "cc"
    if cache.is_file():
        found = re.search(r"^CMAKE_C_COMPILER:\w+=(.+)$", cache.read_text(), re.MULTILINE)
        compiler = found.group(1) if found else compiler
    if not shutil.which(compiler):
        return []
    out = subprocess.run([compiler, "-march=native", "-dM", "-E", "-x", "c", os.devnull],
                         capture_output=True, text=True, check=False).stdout
    wanted = ("__AVX2__", "__AVX512F__", "__AVX512BW__", "__AVX512VNNI__", "__AVX512BF16__", "__AMX_TILE__",
              "__AMX_BF16__")
    return [m.strip("_") for m in wanted if re.search(rf"#define {m} ", out)]


def _median(runs: list[dict[str, Any]], rows: int, key: str) -> float:
    return statistics.median(r["rows"][rows][key] for r in runs)


def summarise(args: argparse.Namespace, results: dict[tuple[str, int], list[dict[str, Any]]],
              rows: list[int], threads: list[int]) -> list[dict[str, Any]]:
    table = []
    for t in threads:
        for n in rows:
            entry: dict[str, Any] = {"rows": n, "threads": t, "prompt_tokens": args.prompt_tokens,
                                     "new_tokens": args.new_tokens}
            for engine in ENGINES:
                runs = results.get((engine, t), [])
                if runs:
                    entry[engine] = {key: _median(runs, n, key) for key in
                                     ("prefill_tps", "decode_tps", "step_ms", "prefill_s", "decode_s")}
                    entry[engine]["repeats"] = [r["rows"][n] for r in runs]
                    if "sequences" in runs[0]["rows"][n]:
                        entry[engine]["sequences"] = runs[0]["rows"][n]["sequences"]
            if "llamacpp" in entry and "ours" in entry:
                entry["prefill_ratio"] = entry["ours"]["prefill_tps"] / entry["llamacpp"]["prefill_tps"]
                entry["decode_ratio"] = entry["ours"]["decode_tps"] / entry["llamacpp"]["decode_tps"]
            if "before" in entry and "llamacpp" in entry:
                entry["before_prefill_ratio"] = entry["before"]["prefill_tps"] / entry["llamacpp"]["prefill_tps"]
                entry["before_decode_ratio"] = entry["before"]["decode_tps"] / entry["llamacpp"]["decode_tps"]
            table.append(entry)
    return table


def print_table(table: list[dict[str, Any]]) -> None:
    def capped(entry: dict[str, Any], engine: str) -> str:
        return f" [{entry[engine]['sequences']}]" if "sequences" in entry.get(engine, {}) else ""

    def rate(entry: dict[str, Any], engine: str, key: str) -> str:
        return f"{entry[engine][key]:.1f}{capped(entry, engine)}" if engine in entry else "-"

    def decode(entry: dict[str, Any], engine: str) -> str:
        return (f"{entry[engine]['decode_tps']:.1f} ({entry[engine]['step_ms']:.1f}){capped(entry, engine)}"
                if engine in entry else "-")

    def ratio(entry: dict[str, Any], key: str) -> str:
        return f"{entry[key]:.2f}" if key in entry else "-"

    head = (f"{'rows':>4} | {'threads':>7} | {'llama.cpp prefill tok/s':>23} | {'ours prefill tok/s':>18} | "
            f"{'ratio':>5} | {'llama.cpp decode tok/s (ms/step)':>32} | {'ours decode tok/s (ms/step)':>27} | "
            f"{'ratio':>5}")
    before = any("before" in e for e in table)
    if before:
        head += f" | {'before: prefill, ratio':>22} | {'before: decode (ms/step), ratio':>31}"
    print(head)
    print("-" * len(head))
    for e in table:
        line = (f"{e['rows']:>4} | {e['threads']:>7} | {rate(e, 'llamacpp', 'prefill_tps'):>23} | "
                f"{rate(e, 'ours', 'prefill_tps'):>18} | {ratio(e, 'prefill_ratio'):>5} | {decode(e, 'llamacpp'):>32} | "
                f"{decode(e, 'ours'):>27} | {ratio(e, 'decode_ratio'):>5}")
        if before:
            line += (f" | {rate(e, 'before', 'prefill_tps') + ', ' + ratio(e, 'before_prefill_ratio'):>22} | "
                     f"{decode(e, 'before') + ', ' + ratio(e, 'before_decode_ratio'):>31}")
        print(line)
    caps = {e["llamacpp"]["sequences"] for e in table if "sequences" in e.get("llamacpp", {})}
    for cap in caps:
        print(f"[{cap}]: llama.cpp decodes at most {cap} sequences in one batch (LLAMA_MAX_SEQ); these are its rates "
              f"at {cap}, which a server taking more requests in rounds of {cap} keeps (its ms/step is a {cap}-row step)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,16,32,64", help="sequences decoded together, comma-separated")
    parser.add_argument("--threads", default="1,2", help="CPU threads of both engines, comma-separated")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64, help="decoding steps after the prefill")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model-dir", default="data/06_models/base_model", help="a Hugging Face model folder")
    parser.add_argument("--json", default=None, help="also write the table (and the machine) to this file")
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs of the llama.cpp build")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the GPU half (our model on the GPU; llama.cpp built with GGML_CUDA, every "
                             "layer offloaded); --threads are then the host's")
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--ours-only", action="store_true", help="skip llama.cpp")
    only.add_argument("--llamacpp-only", action="store_true", help="skip our decoder")
    only.add_argument("--build-only", action="store_true",
                      help="build llama-batched-bench (for --device) and stop (e.g. while the model folder is made)")
    parser.add_argument("--cuda-arch", default=None,
                        help="with --device cuda: build llama.cpp for this compute capability (90: H100/H200) "
                             "instead of the GPU found; the build then needs no GPU")
    parser.add_argument("--cuda-toolkit", default=None, help="the CUDA toolkit to build with (default: nvcc on PATH)")
    parser.add_argument("--llamacpp-binary", default=None,
                        help="a llama-batched-bench built elsewhere (e.g. --build-only --cuda-arch 90 on a machine "
                             "without a GPU) instead of building one")
    parser.add_argument("--before", choices=("python", "packed", "unpacked", "autocast", "host", "none"),
                        default="python",
                        help="our decoder before a change, timed in the same run: python (the Python decoding "
                             "step instead of the C++ one), packed (weights packed; decoding "
                             "steps through the model's forward over an fp32 cache), unpacked (and autocast's own "
                             "linear layers), autocast (only the packing off), host (on a GPU: decoding steps through the model's forward, not the "
                             "static step in CUDA graphs), none")
    # --smoke: our side only (llama.cpp's build takes minutes), on the tiny model of benchmarks/smoke.py
    args = smoke.parse_args(parser, rows="1,2", threads="1", prompt_tokens=16, new_tokens=4, repeats=1,
                            ours_only=True, model_dir=None)
    if args.model_dir is None:
        args.model_dir = str(smoke.model_dir())
    rows = [int(n) for n in args.rows.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    def batched_bench() -> Path:
        if args.llamacpp_binary:
            return Path(args.llamacpp_binary).resolve()
        return build_batched_bench(args.jobs, cuda=args.device == "cuda", cuda_arch=args.cuda_arch,
                                   cuda_toolkit=Path(args.cuda_toolkit).resolve() if args.cuda_toolkit else None)

    if args.build_only:
        print(batched_bench(), flush=True)
        return
    folder = Path(args.model_dir)
    folder = folder if folder.is_absolute() or folder.exists() else ROOT / folder
    if not (folder / "config.json").is_file():
        raise SystemExit(f"{folder}: no Hugging Face model there (make run writes data/06_models/base_model)")

    engines = [e for e in ENGINES if not (e == "llamacpp" and args.ours_only)
               and not (e in ("ours", "before") and args.llamacpp_only) and not (e == "before" and args.before == "none")]
    gguf = binary = None
    if "llamacpp" in engines:
        binary = batched_bench()
        gguf = converted_gguf(folder)
    model = pad_id = None
    bf16 = False
    if "ours" in engines:
        from spader_pipeline.modeling import load_model_and_tokenizer
        from spader_pipeline.modeling.precision import resolve_bf16

        model, tokenizer = load_model_and_tokenizer(folder, device=args.device)
        bf16 = resolve_bf16("auto", torch.device(args.device), model)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        from spader_pipeline.modeling.packed_linear import packing_available

        if not (bf16 and packing_available()) and "before" in engines and args.before != "host":
            engines.remove("before")  # nothing is packed nor fused here: "ours" is already the model's forward

    cpu = cpu_info()
    features = native_features() if "llamacpp" in engines and not args.llamacpp_binary else []
    load_before = os.getloadavg()
    print(f"CPU: {cpu['model_name']} (family {cpu['family']}, model {cpu['model']}), {cpu['cores']} cores; "
          f"avx512_bf16: {'yes' if cpu['avx512_bf16'] else 'no'}, AMX: {' '.join(cpu['amx']) or 'no'}; "
          f"torch {torch.__version__}; load average {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}",
          flush=True)
    if gguf is not None:
        built = (f"built elsewhere ({binary})" if args.llamacpp_binary
                 else f"{binary.relative_to(ROOT)}, -march=native: {', '.join(features) or '?'}")
        print(f"llama.cpp: llama-batched-bench of the llama-cpp-python {LLAMA_CPP_PYTHON} sdist, {built}; "
              f"model {gguf.relative_to(ROOT)}", flush=True)
    if model is not None:
        from spader_pipeline.modeling.decode_step import fused_decode_step_applies
        from spader_pipeline.modeling.precision import bf16_inference

        with bf16_inference(model, args.device, bf16):
            fused = fused_decode_step_applies(model)
        before = {"python": "decoding steps through the Python step (the C++ step off), the same bf16 cache",
                  "packed": "weights packed, decoding steps through the model's forward over an fp32 cache",
                  "unpacked": "decoding steps through the model's forward over an fp32 cache, autocast's own "
                              "linear layers (each weight reordered for oneDNN at every product)",
                  "autocast": "autocast's own linear layers, so decoding steps through the model's forward, over "
                              "the same bf16 cache",
                  "host": "decoding steps through the model's forward, the host reading each step's tokens"}.get(
            args.before)
        from spader_pipeline.modeling.decode_attention import bf16_decode_attention_available
        from spader_pipeline.modeling.native_step import native_available
        from spader_pipeline.modeling.static_cache import static_step_name

        print(f"ours: decode_batch + GrowingKVCache, bf16 autocast {'on' if bf16 else 'off'}"
              + (", weights packed for oneDNN once" if bf16 and packing_available() else "")
              + (", decoding steps fused (modeling/decode_step.py)" if fused else "")
              + (", in C++ (modeling/native_step.py)" if fused and native_available() else "")
              + ({"graph": ", decoding steps on the static step in CUDA graphs (modeling/graph_decode.py)",
                  "static": ", decoding steps on the static step (modeling/graph_decode.py)"}.get(
                  static_step_name(args.device), ""))
              + (", bf16 KV cache (modeling/decode_attention.py)"
                 if args.device == "cpu" and bf16 and bf16_decode_attention_available() else "")
              + (f"; before: {before}" if "before" in engines else ""), flush=True)

    results: dict[tuple[str, int], list[dict[str, Any]]] = {}
    settings = ""
    for repeat in range(args.repeats):
        for t in threads:
            for engine in engines if repeat % 2 == 0 else engines[::-1]:
                started = time.perf_counter()
                if engine == "llamacpp":
                    run = run_batched_bench(binary, gguf, rows, t, args.prompt_tokens, args.new_tokens,
                                            cuda=args.device == "cuda")
                    settings = run["settings"]
                else:
                    run = run_ours(model, rows, t, args.prompt_tokens, args.new_tokens, bf16, pad_id,
                                   args.seed + repeat, variant=args.before if engine == "before" else "ours")
                results.setdefault((engine, t), []).append(run)
                summary = ", ".join(f"{n}: {r['prefill_tps']:.0f} / {r['decode_tps']:.0f}" for n, r in run["rows"].items())
                print(f"  repeat {repeat} threads {t} {engine:8s} ({time.perf_counter() - started:.0f} s) "
                      f"rows: prefill / decode tok/s  {summary}; load {os.getloadavg()[0]:.2f}", flush=True)

    load_after = os.getloadavg()
    table = summarise(args, results, rows, threads)
    print(f"\nOurs vs llama.cpp, {folder.name}: {args.prompt_tokens} prompt tokens + {args.new_tokens} decoding steps "
          f"per row, median of {args.repeats}; ratio = ours / llama.cpp; load average {load_before[0]:.2f} -> "
          f"{load_after[0]:.2f}")
    if settings:
        print(f"llama-batched-bench: {settings}")
    print_table(table)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "cpu": cpu, "march_native": features, "torch": torch.__version__, "bf16_autocast": bf16,
            "llama_cpp_python": LLAMA_CPP_PYTHON, "batched_bench_settings": settings,
            "load_before": load_before, "load_after": load_after, "model_dir": str(folder), "rows": table,
        }, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
