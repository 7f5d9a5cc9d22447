"""MLflow's UI as a user opens it, in a real browser: Debian's Chromium, headless, driven by Selenium with the system
chromedriver (no browser download), on a real `mlflow server` holding a finished run (its model registered) and a
2-point sweep. Skipped where Chromium is missing, unless WORKBENCH_REQUIRE_BROWSER=1 (CI: .ci/run installs it and
sets that, so there a missing browser fails). WORKBENCH_SCREENSHOTS=<folder> keeps the pages' screenshots (docs/)."""

import os
import shutil
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.conftest import run_cli
from workbench.tracking.uris import ui_link

REQUIRE_ENV = "WORKBENCH_REQUIRE_BROWSER"
ASSISTANT_CLOSE = "button[data-component-id='mlflow.assistant.chat_panel.close']"
CHROMIUM, DRIVER = shutil.which("chromium") or "/usr/bin/chromium", shutil.which("chromedriver") or "/usr/bin/chromedriver"


def _problem() -> str | None:
    """Why no browser can be driven here, or None (cheap: files and an import spec, at collection)."""
    import importlib.util

    if not (os.path.exists(CHROMIUM) and os.path.exists(DRIVER)):
        return f"no chromium/chromedriver ({CHROMIUM}, {DRIVER}): apt-get install chromium chromium-driver"
    if importlib.util.find_spec("selenium") is None:
        return "selenium is not installed (pip install -e '.[dev]')"
    return None


PROBLEM = _problem()
REQUIRED = os.environ.get(REQUIRE_ENV, "") not in ("", "0", "false", "no")
pytestmark = pytest.mark.skipif(PROBLEM is not None and not REQUIRED, reason=f"{PROBLEM}; {REQUIRE_ENV} unset: CI sets "
                                "it (.ci/run), so there a missing browser fails this test instead")


def _browser():
    if PROBLEM:  # only with REQUIRE_ENV set (else skipped above)
        pytest.fail(f"a browser is required ({REQUIRE_ENV}=1) but unavailable: {PROBLEM}", pytrace=False)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1600,1000"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(DRIVER), options=options)


def _page(driver, url: str, *texts: str, timeout: float = 60, shot: str | None = None) -> str:
    """Open `url` and wait until the page shows every one of `texts`; returns the page's text."""
    driver.get(url)
    deadline, body = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        for close in driver.find_elements("css selector", ASSISTANT_CLOSE):  # MLflow's chat panel takes a third
            try:
                close.click()
            except Exception:  # noqa: BLE001 - gone meanwhile
                pass
        body = driver.find_element("tag name", "body").text
        if all(t in body for t in texts):
            break
        time.sleep(0.5)
    folder = os.environ.get("WORKBENCH_SCREENSHOTS")
    if shot and folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(Path(folder) / shot))
    missing = [t for t in texts if t not in body]
    assert not missing, f"{url} does not show {missing}; it shows: {body[:1500]}"
    return body


def _charts(driver) -> list[tuple[str, int]]:
    """The metric charts on a run's page: each chart's legend ("<run> (<metric>)") and its number of points."""
    found = driver.execute_script("""
        return Array.from(document.querySelectorAll('.js-plotly-plot')).map(plot => {
            let card = plot;
            while (card.parentElement && !/\\(.+\\)/.test(card.innerText.replace(plot.innerText, ''))) {
                card = card.parentElement;
            }
            const legend = card.innerText.split('\\n').find(line => /\\(.+\\)$/.test(line)) || '';
            return [legend, plot.querySelectorAll('.scatterlayer .point').length];
        });""")
    return [(legend, n) for legend, n in found]


@pytest.mark.slow
def test_a_run_and_a_sweep_look_in_mlflow_as_training_runs_do(mlflow_server, tmp_path):
    url, _ = mlflow_server
    env = {"MLFLOW_TRACKING_URI": url}
    one = run_cli("experiment=quick", "tracking.run_name=digits-dp", "tracking.register_model=digits-dp",
                  "max_steps=60", "tracking.system_metrics_interval=1", "disable_tqdm=true", cwd=tmp_path, env=env)
    assert one.returncode == 0, one.stderr[-3000:]
    sweep = run_cli("-m", "experiment=quick", "privacy.target_epsilon=3,8", "disable_tqdm=true", cwd=tmp_path, env=env)
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    client = MlflowClient(url)
    experiment = client.get_experiment_by_name("workbench").experiment_id
    runs = client.search_runs([experiment])
    run = next(r for r in runs if r.info.run_name == "digits-dp")
    parent = next(r for r in runs if r.info.run_name.startswith("sweep "))
    ml = "?workflowType=machine_learning"  # MLflow 3.17 picks the view by this (or the sidebar's toggle)
    (closing,) = [line for line in one.stdout.splitlines() if line.startswith("done: ")]
    link = closing.rpartition(" | open ")[2]  # the link the job printed, as a user follows it
    assert link == ui_link(url, experiment, run.info.run_id) and link.endswith(ml), closing

    driver = _browser()
    try:
        # The experiment's runs table as the link (ui_link) opens it: the training view, epsilon as its first column,
        # the runs with their dataset, model and source, the sweep's parent.
        body = _page(driver, ui_link(url, experiment), "Model training", "digits-dp", parent.info.run_name[:12],
                     "python -m workbench", "train: Synthetic", "matching runs", "Metrics", "epsilon",
                     shot="mlflow-runs.png")
        assert "Detect Issues" not in body and "Evaluation runs" not in body
        headers = {h.text: h.location["x"] for h in driver.find_elements("css selector", "[role=columnheader]") if h.text}
        assert "epsilon" in headers and headers["epsilon"] < headers["Dataset"], headers  # left of the attributes
        assert str(run.data.metrics["epsilon"])[:5] in body  # the run's epsilon in its row
        # The run, from the printed link: the training view's sidebar (no GenAI pages), its closing line as the
        # description, epsilon among its metrics, system metrics, the model, the dataset.
        body = _page(driver, link, "Model registry", "done: eval_accuracy=", "epsilon", "System metrics",
                     "system/cpu_utilization_percentage", "digits-dp", "train: Synthetic", shot="mlflow-run.png")
        assert "Evaluation runs" not in body and "Observability" not in body
        # Its epsilon chart: epsilon against the step, one point per logged line.
        history = client.get_metric_history(run.info.run_id, "epsilon")
        _page(driver, f"{url}/#/experiments/{experiment}/runs/{run.info.run_id}/model-metrics{ml}",
              "digits-dp (epsilon)", "Step", shot="mlflow-epsilon.png")
        assert (f"{run.info.run_name} (epsilon)", len(history)) in _charts(driver), _charts(driver)
        # The logged model, in the experiment's Models view: epsilon and delta among its metrics, its source run.
        model_id = run.outputs.model_outputs[0].model_id
        _page(driver, f"{url}/#/experiments/{experiment}/models/{model_id}{ml}", "Source run", "digits-dp",
              "epsilon", "delta", "eval_accuracy", shot="mlflow-model.png")
        # The registered version, with the budget as its tags.
        _page(driver, f"{url}/#/models/digits-dp/versions/1{ml}", "workbench.epsilon", "workbench.delta",
              shot="mlflow-registered.png")
        # The sweep's parent and its two children.
        children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        assert len(children) == 2, [(r.info.run_name, r.data.tags) for r in runs] + [sweep.stdout[-3000:], sweep.stderr[-2000:]]
        _page(driver, f"{url}/#/experiments/{experiment}/runs/{parent.info.run_id}{ml}", "sweep_epsilon_all",
              *(c.info.run_name for c in children), shot="mlflow-sweep.png")
    finally:
        driver.quit()
