"""Screenshot the MLflow UI as a user meets it after ``make run`` (docs/images/mlflow_*.png).

Drives a real browser through what a user does: open the runs table at the URL ``make mlflow-ui``
prints (model-training view; the method and evaluation runs are top-level, so nothing is expanded),
tick the latest GRPO and SPADER training runs, press **Compare** (parameter differences, then the
metrics with the held-out results side by side), and open the per-step chart of the comparable
curves (where the Compare view's metric links lead).

One command, from the repository root, after ``make run``::

    python scripts/mlflow_compare_screenshot.py

After ``make compare``, ``--seeds`` shoots the seeded comparison instead: the runs table narrowed
to the latest ``compare`` chain (``tags.chain_run_id = '…'`` in the search box), every method ×
seed training run ticked and compared (held-out scores side by side), and the per-step curve of
whether the methods' updates differ (``adv/corr_vs_grpo``) for all of them
(docs/images/mlflow_seeds_*.png).

After ``make positive-control`` (or ``make positive-control-verl``), ``--positive-control`` shoots the
latest grid run's page with its metrics searched for ``gain`` (the verdict: each cell's gain, the mean over
cells with its interval) and for ``rise`` (the training batches' own reward, first third of the steps to the
last), then every cell's per-step training F1 and own reward on one chart (docs/images/mlflow_pc_*.png).

After ``make compare`` or ``make positive-control``, ``--grid`` shoots the experiment page as it opens:
the latest grid run folded, its jobs under it, then expanded (docs/images/mlflow_grid_*.png).

It starts ``mlflow ui`` on the project's store (``--store``, default ``mlruns/mlflow.db``, with the
project venv's ``mlflow``) on a free port and stops it at the end; ``--url`` uses a running UI
instead. Needs Playwright (``pip install playwright``, in any Python: the script uses nothing else
beyond the standard library) and a Chromium (``apt-get install chromium``); a documentation tool,
not a project dependency.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

#: The comparable per-step curves (same meaning for every method, docs/metrics.md): validation first
#: (greedy, fixed validation questions, step 0 = the warm start), then the training questions.
CURVES = ["val/embedded/recall", "answer/recall", "adv/zero_frac"]
SHOTS = ("mlflow_runs_table.png", "mlflow_runs_selected.png", "mlflow_compare_params.png",
         "mlflow_compare_metrics.png", "mlflow_compare_curves.png")


def _api(url: str, path: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.load(answer)


@contextlib.contextmanager
def mlflow_ui(store: Path, artifacts: Path, mlflow_bin: str) -> Iterator[str]:
    """``mlflow ui`` on ``store`` as ``make mlflow-ui`` runs it (MLflow's GenAI job runner off, one worker:
    0.58 GB where the defaults took ~1.5 GB, which a verl cell beside it cannot spare) on a free loopback
    port; yields its URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = [mlflow_bin, "ui", "--backend-store-uri", f"sqlite:///{store.resolve()}",
            "--default-artifact-root", str(artifacts.resolve()), "--host", "127.0.0.1", "--port", str(port),
            "--workers", "1"]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": os.environ.get("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")}
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                               env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=5).close()
                break
            except (urllib.error.URLError, OSError):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"mlflow ui did not start: {' '.join(argv)}") from None
                time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)


def _experiment_runs(url: str, experiment: str, max_results: int, search: str | None = None) -> tuple[str, list[dict]]:
    """The id of ``experiment`` and its runs (at most ``max_results``, those matching ``search`` if
    given), newest first (REST API)."""
    exp = _api(url, "/api/2.0/mlflow/experiments/get-by-name?experiment_name=" + urllib.parse.quote(experiment))
    experiment_id = exp["experiment"]["experiment_id"]
    body = {"experiment_ids": [experiment_id], "max_results": max_results, "order_by": ["attributes.start_time DESC"],
            **({"filter": search} if search else {})}
    return experiment_id, _api(url, "/api/2.0/mlflow/runs/search", body).get("runs", [])


def latest_method_runs(url: str, experiment: str, methods: list[str]) -> tuple[str, dict[str, dict]]:
    """The experiment id and, per method, its most recent finished training run (REST API)."""
    experiment_id, runs = _experiment_runs(url, experiment, 500)
    found: dict[str, dict] = {}
    for run in runs:
        tags = {t["key"]: t["value"] for t in run["data"].get("tags", [])}
        # Evaluation runs of a trained model carry its `method` tag too; only training runs have `backend`.
        is_training = "backend" in tags
        if (is_training and tags.get("method") in methods and tags["method"] not in found
                and run["info"]["status"] == "FINISHED"):
            found[tags["method"]] = {"id": run["info"]["run_id"], "name": run["info"]["run_name"]}
    missing = sorted(set(methods) - set(found))
    if missing:
        raise SystemExit(f"no finished training run tagged method={missing} in experiment {experiment!r}")
    return experiment_id, found


SEED_SHOTS = ("mlflow_seeds_table.png", "mlflow_seeds_metrics.png", "mlflow_seeds_curves.png")
#: The per-step curves of the seeded comparison: validation recall (did it learn?) and how far each
#: run's advantages are from GRPO's.
SEED_CURVES = ["val/embedded/recall", "adv/corr_vs_grpo"]


def compare_chain_runs(url: str, experiment: str) -> tuple[str, str, list[dict]]:
    """The experiment id, the latest finished ``compare`` chain run's id and the latest finished run
    of every cell (``compare <method> seed<k>``, sorted by name)."""
    experiment_id, runs = _experiment_runs(url, experiment, 1000)
    tags = {r["info"]["run_id"]: {t["key"]: t["value"] for t in r["data"].get("tags", [])} for r in runs}
    chain = next((r for r in runs if tags[r["info"]["run_id"]].get("kedro.pipeline") == "compare"
                  and r["info"]["status"] == "FINISHED"), None)
    if chain is None:
        raise SystemExit(f"no finished `compare` chain run in experiment {experiment!r}: run `make compare` first")
    chain_id = chain["info"]["run_id"]
    latest: dict[str, dict] = {}  # per cell, its latest finished run (a resumed compare spans chains)
    for r in runs:
        if tags[r["info"]["run_id"]].get("chain_kind") == "compare" and r["info"]["status"] == "FINISHED":
            latest.setdefault(r["info"]["run_name"], {"id": r["info"]["run_id"], "name": r["info"]["run_name"]})
    training = list(latest.values())
    return experiment_id, chain_id, sorted(training, key=lambda r: r["name"])


def seed_screenshots(url: str, experiment: str, out: Path, chromium: str) -> list[Path]:
    experiment_id, chain_id, runs = compare_chain_runs(url, experiment)
    paths = _shot_paths(out, SEED_SHOTS)
    with _browser(chromium) as page:
        # 1. the runs table narrowed to the comparison's chain, as the README tells a user to type it
        _open_runs_table(page, url, experiment_id, "tags.chain_kind = 'compare'")
        _tick_runs(page, [run["name"] for run in runs])
        page.screenshot(path=str(paths[0]))
        # 2. Compare: the held-out scores of every method x seed side by side
        _press_compare(page)
        _show_heldout_metrics(page)
        page.screenshot(path=str(paths[1]))
        # 3. the per-step mechanism curve of every run on one chart
        _open_metric_chart(page, url, experiment_id, [run["id"] for run in runs], SEED_CURVES)
        page.screenshot(path=str(paths[2]))
    return paths


GRID_SHOTS = ("mlflow_grid_folded.png", "mlflow_grid_expanded.png")


def latest_grid_run(url: str, experiment: str) -> tuple[str, dict]:
    """The experiment id and its latest grid run (tag ``spader.grid``: one per ``make compare``)."""
    experiment_id, runs = _experiment_runs(url, experiment, 1, "tags.`spader.grid` = 'true'")
    if not runs:
        raise SystemExit(f"no grid run in experiment {experiment!r}: run `make compare` or `make positive-control`")
    return experiment_id, {"id": runs[0]["info"]["run_id"], "name": runs[0]["info"]["run_name"]}


def grid_screenshots(url: str, experiment: str, out: Path, chromium: str) -> list[Path]:
    experiment_id, grid = latest_grid_run(url, experiment)
    paths = _shot_paths(out, GRID_SHOTS)
    with _browser(chromium) as page:
        # 1. the experiment page as it opens: the grid's row, its jobs folded under it (the names
        # column widened, as a user drags it, so that whole names show)
        _open_runs_table(page, url, experiment_id)
        _widen_run_names(page, 260)
        page.screenshot(path=str(paths[0]))
        # 2. the grid's row expanded: the shared part and every cell
        row = page.locator('div[role="row"]', has_text=grid["name"]).first
        row.get_by_role("button").first.click()
        page.wait_for_timeout(2000)
        page.screenshot(path=str(paths[1]))
    return paths


POSITIVE_CONTROL_SHOTS = ("mlflow_pc_verdict.png", "mlflow_pc_rise.png", "mlflow_pc_curves.png")
#: what each cell optimised, step by step: the training batches' F1 (every method's task reward) and the
#: method's own reward (SPADER's with its exploration term), every cell of both trainers on one chart
POSITIVE_CONTROL_CURVES = ["answer/f1", "method_reward/mean"]


def positive_control_runs(url: str, experiment: str) -> tuple[str, dict, list[dict]]:
    """The experiment id, its latest finished grid run (``make positive-control`` or
    ``make positive-control-verl``: the report's metrics are on it) and the latest finished training run
    of every cell (``positive control <method> seed<k>``, ``positive control verl …``), sorted by name. A
    resumed grid runs only the missing cells, so a cell's latest run may sit under an earlier grid."""
    experiment_id, runs = _experiment_runs(url, experiment, 1000)
    finished = [r for r in runs if r["info"]["status"] == "FINISHED"]
    tags = {r["info"]["run_id"]: {t["key"]: t["value"] for t in r["data"].get("tags", [])} for r in finished}
    grid = next((r for r in finished if tags[r["info"]["run_id"]].get("spader.grid") == "true"), None)
    if grid is None:
        raise SystemExit(f"no finished grid run in experiment {experiment!r}: run `make positive-control` first")
    cells: dict[str, dict] = {}
    for r in finished:
        if "backend" in tags[r["info"]["run_id"]]:  # training runs only
            cells.setdefault(r["info"]["run_name"], {"id": r["info"]["run_id"], "name": r["info"]["run_name"]})
    return experiment_id, {"id": grid["info"]["run_id"], "name": grid["info"]["run_name"]}, \
        sorted(cells.values(), key=lambda r: r["name"])


def positive_control_screenshots(url: str, experiment: str, out: Path, chromium: str) -> list[Path]:
    experiment_id, grid, cells = positive_control_runs(url, experiment)
    paths = _shot_paths(out, POSITIVE_CONTROL_SHOTS)
    with _browser(chromium) as page:
        # 1–2. the grid run's page, its metrics searched as a user types: the verdict (every `gain`: the
        # mean over cells with its interval, each cell's), then what the training batches did (`rise`)
        page.goto(f"{url}/#/experiments/{experiment_id}/runs/{grid['id']}?workflowType=machine_learning",
                  timeout=180_000)
        page.wait_for_selector("text=About this run", timeout=180_000)
        page.wait_for_timeout(3000)
        _close_side_panel(page)
        for search, path in zip(("gain", "rise"), paths[:2], strict=True):
            page.get_by_placeholder("Search metrics").fill(search)
            page.wait_for_timeout(1500)
            page.get_by_text("Metrics (").first.evaluate("e => e.scrollIntoView({block: 'start'})")
            page.wait_for_timeout(1000)
            page.screenshot(path=str(path))
        # 3. every cell's per-step curves on one chart
        _open_metric_chart(page, url, experiment_id, [cell["id"] for cell in cells], POSITIVE_CONTROL_CURVES)
        page.screenshot(path=str(paths[2]))
    return paths


def _widen_run_names(page, pixels: int) -> None:
    """Drag the right edge of the runs table's Run Name column ``pixels`` to the right."""
    handle = page.locator('[role="columnheader"][col-id*="Run Name"] .ag-header-cell-resize').first
    box = handle.bounding_box()
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    handle.hover()
    page.mouse.down()
    page.mouse.move(x + 50, y, steps=5)  # the grid starts resizing after a first small drag
    page.mouse.move(x + pixels, y, steps=20)
    page.mouse.up()
    page.wait_for_timeout(1000)


def _shot_paths(out: Path, names: Sequence[str]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    return [out / name for name in names]


@contextlib.contextmanager
def _browser(chromium: str) -> Iterator[Any]:
    """A page of a headless ``chromium`` (Playwright), closed on exit."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        try:
            yield browser.new_page(viewport={"width": 1500, "height": 1000})
        finally:
            browser.close()


def _open_runs_table(page, url: str, experiment_id: str, search: str = "") -> None:
    """The experiment's runs table (model-training view), ``search`` typed into its search box."""
    query = f"&searchFilter={urllib.parse.quote(search)}" if search else ""
    page.goto(f"{url}/#/experiments/{experiment_id}/runs?workflowType=machine_learning{query}", timeout=180_000)
    page.wait_for_selector("text=matching runs", timeout=180_000)
    page.wait_for_timeout(3000)
    _close_side_panel(page)


def _tick_runs(page, names: list[str]) -> None:
    for name in names:
        row = page.locator('div[role="row"]', has_text=name).first
        row.wait_for(timeout=60_000)
        row.locator('input[type="checkbox"]').first.click()
    page.wait_for_timeout(1500)


def _press_compare(page) -> None:
    page.get_by_role("button", name="Compare").first.click()
    page.wait_for_selector("text=Show diff only", timeout=120_000)
    page.wait_for_timeout(5000)
    _close_side_panel(page)
    page.get_by_text("Visualizations", exact=True).first.click()  # collapsed: run names head the columns


def _show_heldout_metrics(page) -> None:
    """In the Compare view: collapse Parameters (the metrics move up) and scroll to the held-out recall."""
    page.get_by_text("Parameters", exact=True).first.click()
    page.wait_for_timeout(1500)
    _scroll_metrics_to(page, re.compile(r"^heldout\/.+\/recall$"))
    page.wait_for_timeout(1000)


def _open_metric_chart(page, url: str, experiment_id: str, run_ids: list[str], keys: list[str]) -> None:
    """The per-step chart of ``keys`` for ``run_ids`` (where a metric link of the Compare view leads)."""
    q = lambda value: urllib.parse.quote(json.dumps(value))  # noqa: E731
    page.goto(f"{url}/#/metric?runs={q(run_ids)}&metric={q(keys[0])}&experiments={q([experiment_id])}"
              f"&plot_metric_keys={q(keys)}&x_axis=step&y_axis_scale=linear&line_smoothness=1"
              f"&show_point=true&workflowType=machine_learning", timeout=180_000)
    page.wait_for_selector("text=Completed Runs", timeout=120_000)
    page.wait_for_timeout(8000)
    _close_side_panel(page)


def _close_side_panel(page) -> None:
    close = page.locator('button[aria-label="Close"]')  # the assistant side panel
    if close.count():
        close.first.click()
        page.wait_for_timeout(1000)


def _scroll_metrics_to(page, label: re.Pattern) -> None:
    """Scroll the Compare view's metrics table (it scrolls inside the page) until ``label``'s row is
    in view, with the mouse wheel over the values as a user does: the names follow only then. The
    table renders only the rows near its view, so the row may appear only while scrolling."""
    first = page.get_by_role("link", name=re.compile(r"^(adv|answer)\/")).first.bounding_box()
    if first is None:
        return
    page.mouse.move(first["x"] + 600, first["y"] + 10)  # over the values: their grid drives the names
    bottom = page.get_by_text("Artifacts", exact=True).first.bounding_box()["y"]
    for _ in range(200):
        target = page.get_by_role("link", name=label).first
        box = target.bounding_box() if target.count() else None
        if box and box["y"] + box["height"] < bottom - 20:
            break
        page.mouse.wheel(0, 40)
        page.wait_for_timeout(100)
    # the names column follows the values' grid on its scroll events: end on a slow one so both settle
    page.wait_for_timeout(500)
    page.mouse.wheel(0, 1)
    page.wait_for_timeout(800)


def screenshots(url: str, experiment: str, methods: list[str], out: Path, chromium: str) -> list[Path]:
    experiment_id, runs = latest_method_runs(url, experiment, methods)
    paths = _shot_paths(out, SHOTS)
    with _browser(chromium) as page:
        # 1. the runs table at the URL `make mlflow-ui` prints, untouched
        _open_runs_table(page, url, experiment_id)
        page.screenshot(path=str(paths[0]))
        # 2. tick the two training runs (top-level rows: nothing to expand)
        _tick_runs(page, [runs[method]["name"] for method in methods])
        page.screenshot(path=str(paths[1]))
        # 3. Compare: the parameter differences (diff only), then the metrics with the held-out rows
        _press_compare(page)
        page.get_by_text("Show diff only").first.click()
        page.wait_for_timeout(1500)
        page.screenshot(path=str(paths[2]))
        _show_heldout_metrics(page)
        page.screenshot(path=str(paths[3]))
        # 4. the overlaid per-step curves of both runs (a metric link of the Compare view)
        _open_metric_chart(page, url, experiment_id, [runs[m]["id"] for m in methods], CURVES)
        page.screenshot(path=str(paths[4]))
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running MLflow UI (default: start one on --store)")
    parser.add_argument("--store", type=Path, default=Path("mlruns/mlflow.db"))
    parser.add_argument("--artifacts", type=Path, default=Path("mlruns/artifacts"))
    parser.add_argument("--mlflow", default=".venv/bin/mlflow", help="the mlflow executable that serves --store")
    parser.add_argument("--experiment", default=None, help="default: spader-pipeline (spader-pipeline-compare with --seeds)")
    parser.add_argument("--methods", nargs=2, default=["grpo", "spader"])
    parser.add_argument("--out", type=Path, default=Path("docs/images"))
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--seeds", action="store_true", help="the latest `make compare` chain instead of `make run`")
    parser.add_argument("--grid", action="store_true", help="the latest grid run, folded then expanded")
    parser.add_argument("--positive-control", action="store_true",
                        help="the latest positive-control grid run's verdict and every cell's curves")
    args = parser.parse_args()
    args.experiment = args.experiment or ("spader-pipeline-positive-control" if args.positive_control else
                                          "spader-pipeline-compare" if args.seeds or args.grid else "spader-pipeline")
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(mlflow_ui(args.store, args.artifacts, args.mlflow))
        if args.positive_control:
            paths = positive_control_screenshots(url.rstrip("/"), args.experiment, args.out, args.chromium)
        elif args.grid:
            paths = grid_screenshots(url.rstrip("/"), args.experiment, args.out, args.chromium)
        elif args.seeds:
            paths = seed_screenshots(url.rstrip("/"), args.experiment, args.out, args.chromium)
        else:
            paths = screenshots(url.rstrip("/"), args.experiment, args.methods, args.out, args.chromium)
    print("wrote", *paths)


if __name__ == "__main__":
    main()
