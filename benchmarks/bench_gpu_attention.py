"""The decoding step's attention on a GPU, by way, against the bytes it must read (issue 63: 768 rows).

The static step (modeling/graph_decode.py) attends one query position per row over a length bucket of
the static cache: each key/value head's 3 query heads are the query positions of one SDPA call
(``[rows, 3, 3, 64]`` against ``[rows, 3, L, 64]``, views of a buffer with room for more positions) with an
additive mask that hides each row's positions past its own length. At 768 rows a step took 8.95-9.7 ms on
the H200 where its bytes take 2.42 ms, and the attention's reads are ~95% of those bytes. This times the
ways the attention could run, over ``--layers`` caches in turn (as a step reads each layer's once), each
way's calls captured in one CUDA graph and replayed (as the step runs), so the time is the kernels':

- ``sdpa``: the step's call, SDPA choosing its kernel (with a mask: not flash);
- ``sdpa-efficient``, ``sdpa-cudnn``, ``sdpa-math``: the same call with SDPA held to one kernel
  (``torch.nn.attention.sdpa_kernel``); a kernel that refuses the inputs is reported so;
- ``bmm``: the scores as one batched product over rows x heads (``[rows * 3, 3, 64] @ [rows * 3, 64, L]``),
  the mask added, softmax in fp32, then the product with the values;
- ``triton``: modeling/triton_attention.py (``SPADER_DECODE_ATTENTION=triton``): one program per row and
  key/value head, the group's query heads one tile, the positions held up to the last row's end (a loop
  up to a bound read on the device); ``triton-length``: its loop over the bucket's length instead (a
  constant trip count, which the compiler can pipeline), the blocks past the end masked; ``triton-b32``,
  ``-b128``, ``-w2``, ``-w8``, ``-s2``, ``-s4``: its launch otherwise (positions an iteration, warps, the
  loop's pipelining stages; :data:`TRITON_LAUNCHES`), which the step's defaults should be;
- ``flex`` (``--flex``): ``torch.nn.attention.flex_attention`` compiled, each row's length as its mask
  (a block mask: blocks past a row's length are skipped, not read), the grouped heads in place
  (``enable_gqa``);
- ``no mask``: SDPA over the real length alone, every row as long (flash's kernel): what a kernel that
  reads only the real positions costs, not a way (rows differ in length).

Each way's output is compared with fp32 attention over the same inputs (largest difference printed).
Floor: the keys and values of the real positions over the device's copy bandwidth, measured here.

    python benchmarks/bench_gpu_attention.py [--rows 768] [--lengths 576 1280] [--layers 30] [--flex] [--json PATH]
    python benchmarks/bench_gpu_attention.py --smoke    (tiny, on the CPU where there is no GPU; no graphs)
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable
from pathlib import Path

import smoke
import torch
import torch.nn.functional as F
from bench_gpu_decode_step import device_rates
from timing import interleaved_medians

HEADS, KV_HEADS, DIM = 9, 3, 64
#: the Triton kernel's launch other than the step's (64 positions an iteration, 4 warps, 3 stages): probes
TRITON_LAUNCHES = {"b32": {"block": 32}, "b128": {"block": 128}, "w2": {"warps": 2}, "w8": {"warps": 8},
                   "s2": {"stages": 2}, "s4": {"stages": 4}}
GROUP = HEADS // KV_HEADS


def layer_inputs(rows: int, length: int, bucket: int, device: str, generator: torch.Generator) -> dict:
    """One layer's query ``[rows, KV_HEADS, GROUP, DIM]``, keys and values ``[rows, KV_HEADS, bucket, DIM]``
    (views of a buffer with 64 positions of spare room, as the static cache's), each row's length (the real
    length less up to 63 positions, as rows of a batch differ) and its additive mask ``[rows, 1, 1, bucket]``."""

    def cache() -> torch.Tensor:
        buffer = torch.randn(rows, KV_HEADS, bucket + 64, DIM, generator=generator, device=device).to(torch.bfloat16)
        return buffer[:, :, :bucket]

    lengths = torch.tensor([length - (row * 37) % 64 for row in range(rows)], device=device)
    keep = torch.arange(bucket, device=device)[None, :] < lengths[:, None]
    mask = torch.where(keep[:, None, None, :], 0.0, torch.full((), -torch.inf, device=device)).to(torch.bfloat16)
    query = torch.randn(rows, KV_HEADS, GROUP, DIM, generator=generator, device=device).to(torch.bfloat16)
    return {"query": query, "keys": cache(), "values": cache(), "mask": mask, "lengths": lengths, "valid": keep,
            "end": lengths.max().reshape(1)}


def reference(inputs: dict, scale: float) -> torch.Tensor:
    """fp32 attention over the same inputs: ``[rows, KV_HEADS, GROUP, DIM]``."""
    scores = inputs["query"].float() @ inputs["keys"].float().transpose(-1, -2) * scale + inputs["mask"].float()
    return torch.softmax(scores, dim=-1) @ inputs["values"].float()


def sdpa(inputs: dict, scale: float) -> torch.Tensor:
    return F.scaled_dot_product_attention(inputs["query"], inputs["keys"], inputs["values"], attn_mask=inputs["mask"],
                                          scale=scale)


def bmm(inputs: dict, scale: float) -> torch.Tensor:
    query, keys, values = inputs["query"], inputs["keys"], inputs["values"]
    rows, bucket = keys.shape[0], keys.shape[2]
    flat_keys = keys.reshape(rows * KV_HEADS, bucket, DIM)  # a view: the rows and heads of the buffer merge
    scores = torch.bmm(query.reshape(rows * KV_HEADS, GROUP, DIM), flat_keys.transpose(1, 2))
    scores = scores.view(rows, KV_HEADS, GROUP, bucket).float() * scale + inputs["mask"]
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.bmm(probs.view(rows * KV_HEADS, GROUP, bucket), values.reshape(rows * KV_HEADS, bucket, DIM))
    return out.view(rows, KV_HEADS, GROUP, DIM)


def triton_kernel(over_length: bool, **launch: int) -> Callable[[dict, float], torch.Tensor]:
    """modeling/triton_attention.py: the positions held, none past the longest row's end (the step's cursor);
    ``over_length``: its loop over the bucket's length, the blocks past the end masked; ``launch``: its
    ``block``, ``warps``, ``stages`` other than the step's."""
    from spader_pipeline.modeling.triton_attention import grouped_decode_attention

    def call(inputs: dict, scale: float) -> torch.Tensor:
        return grouped_decode_attention(inputs["query"], inputs["keys"], inputs["values"], inputs["valid"],
                                        inputs["end"], scale, over_length=over_length, **launch)

    return call


def no_mask(inputs: dict, scale: float) -> torch.Tensor:
    """SDPA over the shortest row's length, no mask: every row as long (flash's kernel where it runs)."""
    real = int(inputs["lengths"].min())
    return F.scaled_dot_product_attention(inputs["query"], inputs["keys"][:, :, :real], inputs["values"][:, :, :real],
                                          scale=scale)


def forced(kernel: str) -> Callable[[dict, float], torch.Tensor]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "math": SDPBackend.MATH}[kernel]

    def call(inputs: dict, scale: float) -> torch.Tensor:
        with sdpa_kernel(backend):
            return sdpa(inputs, scale)

    return call


def flex_decode(layers: list[dict]) -> Callable[[dict, float], torch.Tensor]:
    """flex_attention compiled over ``[rows, 9, 1, 64]`` queries (one position per head, the grouped heads in
    place: ``enable_gqa``), each row's length its block mask (blocks past it skipped)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    masks = {}
    for inputs in layers:
        lengths, bucket = inputs["lengths"], inputs["keys"].shape[2]

        def within(batch, head, q_index, kv_index, lengths=lengths):
            return kv_index < lengths[batch]

        masks[id(inputs)] = create_block_mask(within, B=lengths.shape[0], H=None, Q_LEN=1, KV_LEN=bucket,
                                              device=str(lengths.device))

    def call(inputs: dict, scale: float) -> torch.Tensor:
        rows = inputs["query"].shape[0]
        query = inputs["query"].reshape(rows, HEADS, 1, DIM)  # head j*3+g is group g of key/value head j
        out = compiled(query, inputs["keys"], inputs["values"], block_mask=masks[id(inputs)], scale=scale,
                       enable_gqa=True)
        return out.reshape(rows, KV_HEADS, GROUP, DIM)

    return call


def timed(way: Callable[[dict, float], torch.Tensor], layers: list[dict], scale: float, repeats: int,
          graphs: bool) -> float:
    """Seconds for one pass over ``layers`` (the median of ``repeats`` replays of its CUDA graph, or of eager
    passes where there are no graphs)."""

    def run() -> None:
        for inputs in layers:
            way(inputs, scale)

    run()  # warm: kernels loaded, compiled ways built
    synchronize = torch.cuda.synchronize if graphs else (lambda: None)
    synchronize()
    if graphs:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        run = graph.replay  # noqa: F811 - the pass, replayed
        run()
        synchronize()
    return interleaved_medians({"pass": run}, repeats, sync=synchronize)[0]["pass"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=768)
    parser.add_argument("--lengths", type=int, nargs="+", default=[576, 1280], help="real positions a row")
    parser.add_argument("--quantum", type=int, default=256, help="the length bucket's multiple (the step's)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--flex", action="store_true", help="also flex_attention, compiled (~20 s a shape)")
    parser.add_argument("--json", default=None,
                        help="also write each way's time to this file (a Triton way with its block, warps, stages)")
    args = smoke.parse_args(parser, rows=4, lengths=[96], quantum=64, layers=2, repeats=2)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    graphs = device == "cuda"
    bandwidth, _ = device_rates(device)
    print(f"{torch.__version__} {torch.cuda.get_device_name(0) if graphs else 'cpu'}; copy bandwidth "
          f"{bandwidth / 1e12:.2f} TB/s", flush=True)
    scale = DIM ** -0.5
    ways: dict[str, Callable] = {"sdpa": sdpa, "bmm": bmm, "no mask": no_mask}
    if graphs:
        ways |= {f"sdpa-{kernel}": forced(kernel) for kernel in ("efficient", "cudnn", "math")}
    from spader_pipeline.modeling.triton_attention import available

    launches: dict[str, tuple[int, int, int]] = {}  # a Triton way's launch: (block, warps, stages)
    if available() and graphs:  # not Triton's interpreter: its products of bf16 tiles are wrong
        from spader_pipeline.modeling.triton_attention import launch

        block, warps, stages = launch()
        launches = {"triton": (block, warps, stages)} | {
            f"triton-{name}": (change.get("block", block), change.get("warps", warps), change.get("stages", stages))
            for name, change in TRITON_LAUNCHES.items()}
        ways |= {"triton": triton_kernel(False), "triton-length": triton_kernel(True)}
        ways |= {name: triton_kernel(False, block=b, warps=w, stages=s) for name, (b, w, s) in launches.items()
                 if name != "triton"}
    records = []
    generator = torch.Generator(device).manual_seed(0)  # the caches drawn where they live (GBs at 768 rows)
    print(f"{'rows':>5} {'length':>6} {'bucket':>6} {'way':>15} {'ms a step':>10} {'GB/s':>8} {'x floor':>8} "
          f"{'largest diff':>12}")
    for length in args.lengths:
        bucket = -(-length // args.quantum) * args.quantum
        layers = [layer_inputs(args.rows, length, bucket, device, generator) for _ in range(args.layers)]
        real_bytes = sum(2 * int(inputs["lengths"].sum()) * KV_HEADS * DIM * 2 for inputs in layers)
        floor = real_bytes / bandwidth
        expected = reference(layers[0], scale)
        chosen = dict(ways)
        if args.flex and graphs:
            try:
                chosen["flex"] = flex_decode(layers)
            except Exception as error:  # noqa: BLE001 - a way this torch cannot build: said, the others run
                print(f"flex: not built ({type(error).__name__}: {error})"[:200])
        for name, way in chosen.items():
            try:
                difference = float((way(layers[0], scale).float() - expected).abs().amax()) if name != "no mask" else None
                seconds = timed(way, layers, scale, args.repeats, graphs)
            except Exception as error:  # noqa: BLE001 - a kernel that refuses the inputs: said, the others run
                print(f"{args.rows:5d} {length:6d} {bucket:6d} {name:>15} refused: {type(error).__name__}: {error}"[:220])
                if graphs:
                    with contextlib.suppress(Exception):  # the failed way's queued work, if any
                        torch.cuda.synchronize()
                continue
            shown = f"{difference:12.2e}" if difference is not None else f"{'-':>12}"
            records.append({"rows": args.rows, "length": length, "bucket": bucket, "way": name, "ms": 1e3 * seconds,
                            "floor_ms": 1e3 * floor, "largest_diff": difference, "launch": launches.get(name)})
            print(f"{args.rows:5d} {length:6d} {bucket:6d} {name:>15} {1e3 * seconds:10.3f} "
                  f"{real_bytes / seconds / 1e9:8.0f} {seconds / floor:8.2f} {shown}", flush=True)
        print(f"{args.rows:5d} {length:6d} {bucket:6d} {'floor':>15} {1e3 * floor:10.3f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(0) if graphs else "cpu",
                                               "torch": torch.__version__, "bandwidth": bandwidth,
                                               "ways": records}, indent=2) + "\n")


if __name__ == "__main__":
    main()
