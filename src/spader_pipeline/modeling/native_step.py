"""The CPU decoding step and its attention in C++, built once per machine.

At one decoding row a step of SmolLM2 is mostly not arithmetic: around the products that read its
bf16 weights, the Python step (:class:`~spader_pipeline.modeling.decode_step.FusedDecodeStep`: some
900 operator calls, the cache's bookkeeping, an attention per block) took nearly as long again
(docs/performance.md, results.md). ``native/decode_step.cpp`` computes the same step in C++, one call
per step, and attends over the bf16 cache with its own two loops around ATen's softmax:

* ``spader_native::decode_step``: :meth:`FusedDecodeStep.__call__` after the embedding and the
  rotary tables, rounding for rounding, so the logits are the Python step's bit for bit: the same
  packed oneDNN products, ATen's own sum (the norms' means), SiLU and softmax, and the elementwise rest
  (residual additions, the norms' scaling, the rotary embedding, bf16 casts, SwiGLU's product) as
  loops of its own that round each operation as ATen's kernels do (built without fused multiply-adds);
  the cache's new positions written in place (:meth:`~spader_pipeline.modeling.kv_cache.GrowingKVCache.reserve`);
* ``spader_native::decode_attention``: one query position per row over a bf16 cache, fp32
  arithmetic, each key/value head's keys and values read once for its group of query heads. The
  model's own decoding forward (``sdpa_gqa``'s decoding branch) attends with it too, so both paths
  agree bit for bit.

It is built with ``torch.utils.cpp_extension`` (:data:`CFLAGS`, OpenMP as torch's own) into
torch's extension directory (``$TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``),
under a name keyed by the source, torch's version, Python and the CPU's flags: the first process on a
machine builds it (concurrent processes wait on a lock that a killed builder does not leave behind),
later ones load it. ``make install`` builds it (``python -m spader_pipeline.modeling.native_step``:
exits non-zero where it does not build, unless :data:`REQUIREMENT_ENV` is ``optional``). Where it
does not build (no C++ compiler, no ninja) or its attention differs from fp32 SDPA,
:func:`native_available` is false, a warning says so once per process, and decoding runs the Python
step with the same bf16 keys (held in fp32), attending with :func:`sdpa_decode_reference`: the same
tokens up to the order of fp32 sums (``tests/modeling/test_modeling_decoding_path.py``), slower.

Builders take turns under an ``flock``. Where there is none (Windows has no ``fcntl``) they do not:
torch's own lock file keeps them apart, and one left by a killed build is not removed.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    import fcntl
except ImportError:  # not POSIX (Windows): builders do not take turns (the module's docstring)
    fcntl = None

__all__ = ["NATIVE_STEP", "REQUIREMENT_ENV", "STEP_ENV", "env_choice", "build_problem", "native_available", "sdpa_decode_reference"]

logger = logging.getLogger(__name__)



def env_choice(name: str, choices: dict[str, bool], default: str) -> bool:
    """The switch ``choices[os.environ[name]]`` (``default`` where unset or empty); any other value is an
    error naming the choices, never silently the default."""
    value = os.environ.get(name, "").strip().lower() or default
    if value not in choices:
        raise ValueError(f"{name}={os.environ[name]!r}: use one of {', '.join(choices)}")
    return choices[value]


#: the variable that picks the decoding step of every process started with it: ``cpp`` (the default) or
#: ``python``, the same sums in another order (within the bound of tests/modeling/test_modeling_decoding_path.py):
#: how a run is repeated under numerics the tests accept (``make positive-control``, docs/results.md)
STEP_ENV = "SPADER_DECODE_STEP"
#: run decoding steps through the C++ step where it builds (benchmarks and tests switch it off to time or
#: check the Python step in the same process; the attention follows ``decode_attention.BF16_CACHE``)
NATIVE_STEP = env_choice(STEP_ENV, {"cpp": True, "python": False}, "cpp")
SOURCE = Path(__file__).with_name("native") / "decode_step.cpp"
#: -march=native: the build is for this machine (its name carries the CPU's flags); -ffp-contract=off: a
#: product and a sum are rounded apart, as ATen's elementwise kernels round them, unless the source asks for
#: a fused multiply-add (the attention's loops); OpenMP as torch's (the library binds to the libgomp torch loaded)
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp")
LDFLAGS = ("-fopenmp",)
#: the attention's largest difference from fp32 SDPA on the same bf16 keys and values allowed by the
#: availability check: reassociation of fp32 sums only
CHECK_TOLERANCE = 1e-4
#: ``optional``: this machine may have no C++ compiler, so a step that does not build fails neither
#: ``make install`` nor the test that requires it (tests/modeling/test_modeling_native_step.py);
#: anything else (the default): it must build
REQUIREMENT_ENV = "SPADER_NATIVE_STEP"
_warned = False


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux), else the platform's processor string."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    return platform.processor() or platform.machine()


def extension_name() -> str:
    """The build's name: one per source, torch version, Python environment, compiler flags and CPU. The
    environment (``sys.prefix``) is part of it because a build's ninja file names the include folders of
    the torch it was built against: two virtual environments sharing one build folder would each find the
    other's build stale and build again in every process."""
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), sys.implementation.cache_tag.encode(),
                 sys.prefix.encode(), " ".join(CFLAGS + LDFLAGS).encode(), _cpu_flags().encode()):
        key.update(part)
    return f"spader_native_{key.hexdigest()[:16]}"


def build_directory(name: str) -> Path:
    """The build's folder: under ``TORCH_EXTENSIONS_DIR`` where set, else torch's default root, one folder
    per :func:`extension_name`."""
    from torch.utils import cpp_extension

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()) / name


@contextlib.contextmanager
def _one_builder(directory: Path) -> Iterator[None]:
    """One process at a time builds or loads the extension in ``directory``, under an ``flock`` that the
    kernel releases when its holder dies. torch's own lock (a file ``lock`` that its builder creates
    and deletes) outlives a builder that was killed, and every later process would wait on it forever;
    inside this lock no live process holds torch's, so a ``lock`` found there is stale and removed."""
    directory.mkdir(parents=True, exist_ok=True)
    if fcntl is None:
        yield
        return
    with (directory / "builder.flock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = directory / "lock"
            if stale.exists():
                logger.warning("removing %s, left by a build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """The venv's scripts (the ``ninja`` wheel's binary) on ``PATH`` while building: torch's builder
    looks for ``ninja`` there, and a venv used without activation does not put them on it."""
    scripts, path = str(Path(sys.executable).parent), os.environ.get("PATH", "")
    os.environ["PATH"] = scripts + os.pathsep + path
    try:
        yield
    finally:
        os.environ["PATH"] = path


@functools.lru_cache(maxsize=1)
def _built() -> bool:
    """Build (or load) the extension once per process; ``False`` where it does not build or check out,
    with a warning, once per process."""
    problem = build_problem()
    if problem is not None and torch.backends.mkldnn.is_available():
        _warn_once(problem)
    return problem is None


def build_problem() -> str | None:
    """Build (or load) the extension and check its attention: ``None`` where it is ready, else why not."""
    if not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN, which the C++ step's products are"
    try:
        from torch.utils import cpp_extension

        name = extension_name()
        directory = build_directory(name)
        with _one_builder(directory), _ninja_on_path():
            cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                               build_directory=str(directory), is_python_module=False, verbose=False)
    except Exception as error:  # noqa: BLE001 - no compiler, no ninja, a build error: the Python step
        return f"it did not build ({type(error).__name__}: {error})"
    if not _attention_matches_sdpa():
        return "its attention differs from fp32 SDPA here"
    return None


def _warn_once(problem: str) -> None:
    """The one warning of a process whose C++ step is unavailable: why, what it costs, how to mend it."""
    global _warned
    if _warned:
        return
    _warned = True
    logger.warning("the C++ decoding step is not available here: %s. Decoding runs the Python step with the same "
                   "bf16 keys (the same tokens up to the order of fp32 sums), slower (docs/performance.md). To build "
                   "it, install a C++ compiler (g++ or clang) and run make install.", problem[:300])


def sdpa_decode_reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                          scale: float) -> torch.Tensor:
    """The decoding attention in fp32 SDPA over the widened cache: what the native attention is checked
    against, and what runs where it does not. ``query`` fp32 ``[n, H, 1, D]``; ``keys``/``values``
    ``[n, H_kv, L, D]`` (bf16 or fp32); ``mask`` bool ``[n, L]`` (True: attend) or ``None``; returns fp32
    ``[n, H, 1, D]``. Autocast is off inside: the reference is fp32 whatever the caller runs under."""
    with torch.autocast("cpu", enabled=False):
        return F.scaled_dot_product_attention(
            query, keys.float(), values.float(), attn_mask=None if mask is None else mask[:, None, None, :],
            scale=scale, enable_gqa=keys.shape[1] != query.shape[1])


def _attention_matches_sdpa() -> bool:
    """The native attention against fp32 SDPA on bf16 keys and values: grouped heads, strided cache
    views, with and without a mask."""
    generator = torch.Generator().manual_seed(0)
    for rows, length, masked in ((3, 37, True), (2, 130, False), (1, 5, False)):
        query = torch.randn(rows, 6, 16, generator=generator)
        keys = torch.randn(rows, 3, length + 7, 16, generator=generator).to(torch.bfloat16)[:, :, :length]
        values = torch.randn(rows, 3, length + 7, 16, generator=generator).to(torch.bfloat16)[:, :, :length]
        mask = None
        if masked:
            mask = torch.ones(rows, length, dtype=torch.bool)
            mask[-1, : length // 3] = False
        with torch.no_grad(), torch.autocast("cpu", enabled=False):  # checked on first use, maybe under autocast
            got = torch.ops.spader_native.decode_attention(query, keys, values, mask, 0.25)
            expected = sdpa_decode_reference(query[:, :, None], keys, values, mask, 0.25)[:, :, 0]
        if (got - expected).abs().max().item() > CHECK_TOLERANCE:
            return False
    return True


def native_available() -> bool:
    """Whether the C++ step and attention can run here: the extension built, loaded and checked out in
    this process."""
    return _built()


def main() -> int:
    """``python -m spader_pipeline.modeling.native_step`` (``make install``): build the step here and check
    it; 1 where it does not build, unless :data:`REQUIREMENT_ENV` is ``optional`` (or the step does not
    apply: a torch without oneDNN)."""
    problem = build_problem()
    optional = os.environ.get(REQUIREMENT_ENV, "").strip().lower() == "optional"
    if problem is None:
        message = f"the C++ decoding step is built and checked ({build_directory(extension_name())})"
    elif optional or not torch.backends.mkldnn.is_available():
        message = (f"the C++ decoding step is not available here: {problem}\ndecoding will run the Python step "
                   "(the same tokens up to the order of fp32 sums, slower: docs/performance.md)")
    else:
        message = (f"the C++ decoding step is not available here: {problem}\ninstall a C++ compiler (g++ or clang) "
                   f"and run make install again, or install without it: make install {REQUIREMENT_ENV}=optional "
                   "(decoding then runs the Python step, slower: docs/performance.md)")
        print(message, file=sys.stderr)  # noqa: T201 - the command's output
        return 1
    print(message)  # noqa: T201 - the command's output
    return 0


if __name__ == "__main__":
    sys.exit(main())
