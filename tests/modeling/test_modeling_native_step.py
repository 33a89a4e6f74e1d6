"""The C++ decoding step's build and its attention's contract (modeling/native_step.py,
modeling/native/decode_step.cpp). The step's results against the Python step and the model's forward are
in test_modeling_decode_step.py, the attention's against fp32 SDPA in test_modeling_decode_attention.py.

The tests that need the build skip where it does not build; :func:`test_the_native_step_builds_here` fails
there instead, unless ``SPADER_NATIVE_STEP=optional`` says this machine may have no C++ compiler."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading

import pytest
import torch

from spader_pipeline.modeling import native_step
from spader_pipeline.modeling.native_step import extension_name, native_available

needs_native = pytest.mark.skipif(not native_available(), reason="the native decoding step does not build here")


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN: the C++ step does not apply")
def test_the_native_step_builds_here():
    """A compile error must not leave the suite green with every native test skipped."""
    if os.environ.get(native_step.REQUIREMENT_ENV, "").strip().lower() == "optional":
        pytest.skip(f"{native_step.REQUIREMENT_ENV}=optional: this machine may have no C++ compiler")
    assert native_available(), (f"the C++ decoding step does not build here: {native_step.build_problem()}; "
                                f"set {native_step.REQUIREMENT_ENV}=optional on a machine without a C++ compiler")


def _broken_source(monkeypatch, tmp_path) -> None:
    """A source that does not compile, built into a folder of this test's."""
    broken = tmp_path / "decode_step.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(native_step, "SOURCE", broken)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN: the C++ step does not apply")
def test_the_install_step_fails_where_the_step_does_not_build_unless_it_is_optional(monkeypatch, tmp_path, capsys):
    """``make install``'s step (``python -m spader_pipeline.modeling.native_step``): 0 where it builds; 1,
    saying how to mend it, where it does not; 0 with ``SPADER_NATIVE_STEP=optional``."""
    if native_available():
        assert native_step.main() == 0 and "built and checked" in capsys.readouterr().out
    _broken_source(monkeypatch, tmp_path)
    monkeypatch.delenv(native_step.REQUIREMENT_ENV, raising=False)
    assert native_step.main() == 1
    err = capsys.readouterr().err
    assert "install a C++ compiler" in err and f"{native_step.REQUIREMENT_ENV}=optional" in err
    monkeypatch.setenv(native_step.REQUIREMENT_ENV, "optional")
    assert native_step.main() == 0 and "Python step" in capsys.readouterr().out


def test_without_fcntl_the_module_imports_and_builders_do_not_take_turns(monkeypatch, tmp_path):
    """Windows has no ``fcntl``: the module still imports, and the build goes on without the ``flock``,
    leaving torch's own lock file alone (only a builder that holds the flock may call one stale)."""
    monkeypatch.setitem(sys.modules, "fcntl", None)  # import fcntl: ImportError
    spec = importlib.util.spec_from_file_location("native_step_without_fcntl", native_step.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.fcntl is None
    (tmp_path / "lock").touch()
    with module._one_builder(tmp_path):
        pass
    assert (tmp_path / "lock").exists() and not (tmp_path / "builder.flock").exists()


def test_the_build_is_named_by_its_source_torch_and_the_cpu(monkeypatch, tmp_path):
    """A build made for another CPU (-march=native), torch, virtual environment or source is never loaded
    (nor rebuilt over by another environment's process): each has its own name."""
    name = extension_name()
    assert name.startswith("spader_native_") and extension_name() == name
    monkeypatch.setattr(native_step, "_cpu_flags", lambda: "flags : fpu sse2")
    assert extension_name() != name
    monkeypatch.undo()
    monkeypatch.setattr(native_step.sys, "prefix", str(tmp_path / "another-venv"))
    assert extension_name() != name
    monkeypatch.undo()
    changed = tmp_path / "decode_step.cpp"
    changed.write_bytes(native_step.SOURCE.read_bytes() + b"\n// changed\n")
    monkeypatch.setattr(native_step, "SOURCE", changed)
    assert extension_name() != name


@needs_native
@pytest.mark.parametrize(("keys_dtype", "heads", "message"), [
    (torch.float32, 6, "a bf16 cache"),
    (torch.bfloat16, 5, "shapes"),
])
def test_malformed_attention_inputs_get_a_clear_error(keys_dtype, heads, message):
    query = torch.randn(2, heads, 16)
    keys = torch.randn(2, 3, 9, 16).to(keys_dtype)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.spader_native.decode_attention(query, keys, keys, None, 0.25)


@needs_native
def test_a_fully_masked_row_is_zeros_as_sdpas_and_leaves_the_other_rows_alone():
    """A row with no position to attend to gets zeros (fp32 SDPA's answer here too); the others are
    unaffected. decode_batch never builds such a row: every row attends to its newest token."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 4, 16, generator=generator)
    keys = torch.randn(2, 2, 5, 16, generator=generator).to(torch.bfloat16)
    values = torch.randn(2, 2, 5, 16, generator=generator).to(torch.bfloat16)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[0] = False
    out = torch.ops.spader_native.decode_attention(query, keys, values, mask, 0.25)
    alone = torch.ops.spader_native.decode_attention(query[1:], keys[1:], values[1:], None, 0.25)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[1:], alone)


@needs_native
@pytest.mark.parametrize("dim", [8, 64])
def test_masked_positions_after_the_last_attended_one_change_no_bit(dim):
    """The host loop attends over its cache's exact length, the static step over a length bucket whose tail
    is masked: the same result, bit for bit, for rows shorter and longer than a vector register (a short
    softmax row would otherwise sum in a scalar order of its own) and buckets of any size."""
    generator = torch.Generator().manual_seed(0)
    for length in [*range(1, 40), 63, 64, 65, 200, 511]:
        query = torch.randn(3, 6, dim, generator=generator)
        keys = torch.randn(3, 2, length, dim, generator=generator).to(torch.bfloat16)
        values = torch.randn(3, 2, length, dim, generator=generator).to(torch.bfloat16)
        mask = torch.ones(3, length, dtype=torch.bool)
        mask[1, : min(3, length - 1)] = False  # a padded row
        exact = torch.ops.spader_native.decode_attention(query, keys, values, mask, 0.3)
        for bucket in (256, 1024):
            if bucket < length:
                continue
            tail = bucket - length
            padded = [torch.cat([t, torch.randn(3, 2, tail, dim, generator=generator).to(torch.bfloat16)], 2)
                      for t in (keys, values)]  # whatever the tail holds: it is masked
            bucket_mask = torch.cat([mask, torch.zeros(3, tail, dtype=torch.bool)], 1)
            out = torch.ops.spader_native.decode_attention(query, *padded, bucket_mask, 0.3)
            assert torch.equal(out, exact), (length, bucket)


def test_a_build_killed_midway_does_not_stop_the_next_one(monkeypatch, tmp_path):
    """torch's build lock (a file its builder deletes when done) outlives a builder that was killed;
    the next process must build anyway, not wait on it forever. Here a source that does not compile
    fails fast: the point is that the call returns, with the stale lock gone."""
    _broken_source(monkeypatch, tmp_path)
    directory = native_step.build_directory(extension_name())
    directory.mkdir(parents=True)
    (directory / "lock").touch()  # what a killed build leaves
    outcome: list[bool] = []
    worker = threading.Thread(target=lambda: outcome.append(native_step._built.__wrapped__()), daemon=True)
    worker.start()
    worker.join(timeout=300)  # a guard against hanging the suite, not a timing: it returns in about a second
    assert outcome == [False], "the build waited on a lock no live process holds"
    assert not (directory / "lock").exists()
