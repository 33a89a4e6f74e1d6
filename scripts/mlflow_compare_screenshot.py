"""Screenshot MLflow's Compare view of the latest GRPO and SPADER training runs (docs/images/).

Drives a real browser through what a user does after ``make run`` and ``make mlflow-ui``: open the
experiment in the model-training view, expand the ``kedro run`` run, tick the GRPO and SPADER runs,
press **Compare** (parameter differences), then open the per-step chart of recall, retrieval
recall and reward for both runs (where the Compare view's metric links lead).

Needs Playwright (``pip install playwright``) and a Chromium (``apt-get install chromium``); it is a
documentation tool, not a project dependency. Usage::

    make mlflow-ui &    # or any running MLflow UI on the project's store
    python scripts/mlflow_compare_screenshot.py --url http://127.0.0.1:5000 --experiment spader-pipeline
"""

from __future__ import annotations

import argparse
import json
import urllib.parse
import urllib.request
from pathlib import Path

CURVES = ["answer/recall", "retrieval/recall", "method_reward/mean"]


def _api(url: str, path: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode() if body is not None else None,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.load(answer)


def latest_method_runs(url: str, experiment: str, methods: list[str]) -> tuple[str, dict[str, dict]]:
    """The experiment id and, per method, its most recent finished training run (REST API)."""
    exp = _api(url, "/api/2.0/mlflow/experiments/get-by-name?experiment_name=" + urllib.parse.quote(experiment))
    experiment_id = exp["experiment"]["experiment_id"]
    runs = _api(url, "/api/2.0/mlflow/runs/search", {"experiment_ids": [experiment_id], "max_results": 500,
                                                     "order_by": ["attributes.start_time DESC"]})["runs"]
    found: dict[str, dict] = {}
    for run in runs:
        tags = {t["key"]: t["value"] for t in run["data"].get("tags", [])}
        # Evaluation runs of a trained model carry its `method` tag too; only training runs have `backend`.
        is_training = "backend" in tags
        if (is_training and tags.get("method") in methods and tags["method"] not in found
                and run["info"]["status"] == "FINISHED"):
            found[tags["method"]] = {"id": run["info"]["run_id"], "name": run["info"]["run_name"],
                                     "parent": tags.get("mlflow.parentRunId")}
    missing = sorted(set(methods) - set(found))
    if missing:
        raise SystemExit(f"no finished training run tagged method={missing} in experiment {experiment!r}")
    return experiment_id, found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:5000")
    parser.add_argument("--experiment", default="spader-pipeline")
    parser.add_argument("--methods", nargs=2, default=["grpo", "spader"])
    parser.add_argument("--out", type=Path, default=Path("docs/images"))
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    experiment_id, runs = latest_method_runs(args.url, args.experiment, args.methods)
    args.out.mkdir(parents=True, exist_ok=True)
    q = lambda value: urllib.parse.quote(json.dumps(value))  # noqa: E731
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1500, "height": 1000})
        # 1. the runs table in the model-training view; the method runs are nested under the kedro run
        page.goto(f"{args.url}/#/experiments/{experiment_id}/runs?workflowType=machine_learning", timeout=180_000)
        page.wait_for_selector("text=matching runs", timeout=180_000)
        close = page.locator('button[aria-label="Close"]')  # the assistant side panel
        if close.count():
            close.first.click()
        if any(run["parent"] for run in runs.values()):
            page.locator('button[data-component-id*="runnamecellrenderer"]').first.click()
        for method in args.methods:
            row = page.locator('div[role="row"]', has_text=runs[method]["name"]).first
            row.wait_for(timeout=60_000)
            row.locator('input[type="checkbox"]').first.click()
        page.wait_for_timeout(1500)
        page.screenshot(path=str(args.out / "mlflow_runs_selected.png"))
        # 2. Compare: the parameter differences (diff only) and metrics of the two runs
        page.get_by_role("button", name="Compare").first.click()
        page.wait_for_selector("text=Show diff only", timeout=120_000)
        page.wait_for_timeout(5000)
        for section in ("Visualizations", "Run details"):  # collapsed: parameters and metrics in view
            page.get_by_text(section, exact=True).first.click()
        page.get_by_text("Show diff only").first.click()
        page.wait_for_timeout(1500)
        page.screenshot(path=str(args.out / "mlflow_compare_params.png"))
        # 3. the overlaid per-step curves of both runs (a metric link of the Compare view)
        ids = [runs[m]["id"] for m in args.methods]
        page.goto(f"{args.url}/#/metric?runs={q(ids)}&metric={q(CURVES[0])}&experiments={q([experiment_id])}"
                  f"&plot_metric_keys={q(CURVES)}&x_axis=step&y_axis_scale=linear&line_smoothness=1"
                  f"&show_point=true&workflowType=machine_learning", timeout=180_000)
        page.wait_for_selector("text=Completed Runs", timeout=120_000)
        page.wait_for_timeout(8000)
        close = page.locator('button[aria-label="Close"]')
        if close.count():
            close.first.click()
            page.wait_for_timeout(1500)
        page.screenshot(path=str(args.out / "mlflow_compare_curves.png"))
        browser.close()
    names = ("mlflow_runs_selected.png", "mlflow_compare_params.png", "mlflow_compare_curves.png")
    print("wrote", *(args.out / name for name in names))  # noqa: T201


if __name__ == "__main__":
    main()
