"""The decoding path a lease's ``profile`` step gives the runs after it (scripts/gpu_decoding_choice.py): a
choice replaces the default only where it is clearly faster, and only where the graph tests passed."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_decoding_choice.py"


@pytest.fixture(scope="module")
def choice():
    spec = importlib.util.spec_from_file_location("gpu_decoding_choice", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _attention(**launches_ms) -> dict:
    ways = [{"way": "sdpa", "ms": 0.5, "launch": None}]  # SDPA's kernels: no launch to choose
    ways += [{"way": name, "ms": ms, "launch": [int(part) for part in name.split("_")[1:]] or [64, 4, 3]}
             for name, ms in launches_ms.items()]
    return {"ways": ways}


def test_another_launch_is_chosen_only_where_clearly_faster(choice):
    assert choice.choose_launch(_attention(triton=1.0, triton_128_8_2=0.9)) == "128,8,2"
    assert choice.choose_launch(_attention(triton=1.0, triton_128_8_2=0.98)) is None  # within the margin
    assert choice.choose_launch(_attention(triton=1.0)) is None
    assert choice.choose_launch({"ways": [{"way": "sdpa", "ms": 0.4, "launch": None}]}) is None


def _profile(**paths_ms) -> dict:
    small = {"rows": 8, "graph": 0.002, "fused_triton": 0.0001}  # another row count: not the rollout's
    seconds = {path: ms / 1e3 if ms is not None else None for path, ms in paths_ms.items()}  # None: the path failed
    return {"rows": [small, {"rows": 768, **seconds}]}


@pytest.mark.parametrize(("paths", "passed", "chosen"), [
    ({"graph": 9.0, "triton": 8.0, "fused": 8.5, "fused_triton": 6.0}, True, "fused_triton"),
    ({"graph": 9.0, "triton": 8.0, "fused": 8.5, "fused_triton": 6.0}, False, "graph"),  # graph tests failed
    ({"graph": 9.0, "triton": 8.9, "fused": None, "fused_triton": None}, True, "graph"),  # within the margin
    ({"graph": 9.0, "triton": None, "fused": 7.0, "fused_triton": None}, True, "fused"),  # failed paths left out
    ({"graph": None, "fused": 7.0}, True, "graph"),  # nothing to compare with
])
def test_the_runs_path_is_the_fastest_at_the_rollouts_rows_where_the_tests_passed(choice, paths, passed, chosen):
    path, (attention, kernels) = choice.choose_path(_profile(**paths), passed)
    assert path == chosen and (attention, kernels) == choice.PATHS[chosen]


def test_verl_servers_path_is_chosen_at_its_batch_sizes(choice):
    """verl's agent loop sends our server batches of 1-8: its path is the fastest at 8 rows (the largest row
    count timed of at most :data:`SERVER_ROWS`), which need not be the rollout's."""
    profile = {"rows": [{"rows": 1, "graph": 2.0, "fused": 1.0}, {"rows": 8, "graph": 2.2, "fused": 1.1, "triton": 2.5},
                        {"rows": 256, "graph": 4.5}, {"rows": 768, "graph": 9.0, "triton": 6.0}]}
    assert choice.choose_path(profile, True)[0] == "triton"
    assert choice.choose_path(profile, True, choice.SERVER_ROWS)[0] == "fused"
    assert choice.choose_path({"rows": [{"rows": 768, "graph": 9.0, "triton": 6.0}]}, True, 8)[0] == "graph"


def test_the_choice_is_written_where_the_runs_read_it(choice, tmp_path, capsys):
    profile = tmp_path / "profile_step.json"
    profile.write_text(json.dumps(_profile(graph=9.0, triton=6.0)))
    assert choice.main(["path", str(profile), "0", str(tmp_path)]) == 0
    assert (tmp_path / "attention").read_text() == "triton\n" and (tmp_path / "kernels").read_text() == "aten\n"
    # at 8 rows (_profile's small row): fused_triton against graph
    assert (tmp_path / "server_attention").read_text() == "triton\n"
    assert (tmp_path / "server_kernels").read_text() == "triton\n"
    assert "triton" in capsys.readouterr().out
    attention = tmp_path / "attention.json"
    attention.write_text(json.dumps(_attention(triton=1.0, triton_32_4_3=0.5)))
    assert choice.main(["launch", str(attention)]) == 0
    assert capsys.readouterr().out.strip() == "32,4,3"
    assert choice.main(["nothing"]) == 2


def test_the_paths_are_the_benchmarks(choice):
    """The choice reads the decoding benchmark's table by its paths' names: each of its graphs' paths with the
    switches the benchmark runs it with (the two lists kept apart: the choice runs on the bare machine's Python
    without the benchmark's imports)."""
    sys.path.insert(0, str(SCRIPT.parents[1] / "benchmarks"))
    import bench_gpu_decode_step as bench

    assert set(choice.PATHS) == set(bench.GRAPH_PATHS)
    for path, (attention, kernels) in choice.PATHS.items():
        assert bench.PATHS[path][1:] == (True, attention, kernels), path  # in CUDA graphs
