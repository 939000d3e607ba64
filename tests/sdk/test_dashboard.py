"""The web dashboard end to end: the real mesh with its dashboard process, a real RL job, and
Debian's headless Chromium driven by Selenium (the browser .ci/run installs; nothing is
downloaded). Screenshots go to a tmp folder; their paths are printed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from identity_helpers import other_tenant_key

import opentinker
from opentinker import JobSpec, ModelSpec, RlConfig, SamplingParams
from opentinker.errors import InvalidArgumentError, JobFailedError
from opentinker.services.launcher.mesh import LocalMesh, MeshSettings
from opentinker.sinks import JsonlSink, TensorBoardSink

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium (dev extra) missing")
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("Debian's chromium and chromium-driver are not installed (.ci/run installs "
                    "them with apt-get as root)")  # fmt: skip
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--window-size=1400,1000"):  # fmt: skip
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(CHROMEDRIVER))
    driver.implicitly_wait(0)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    settings = MeshSettings(
        run_root=tmp_path_factory.mktemp("mesh"), dashboard_port=0, warm_spares=0
    )
    with LocalMesh(settings) as running:
        yield running


def letter_job(model: Path, *, name: str, steps: int) -> JobSpec:
    rl = RlConfig(
        env_name="letter", env_options={"num_letters": "4"}, steps=steps, prompts_per_step=4,
        samples_per_prompt=4, learning_rate=1e-3, sampling=SamplingParams(max_new_tokens=1),
        seed=1,
    )  # fmt: skip
    return JobSpec(name=name, model=ModelSpec(base_model=str(model), finetune="full"), rl=rl)


def wait_for(condition, *, timeout: float, what: str):
    """Polls ``condition`` until truthy; an element that went stale or is not there yet (the
    page was navigating, as after the cancel form's redirect) only means: look again."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if value := condition():
                return value
        except (StaleElementReferenceException, NoSuchElementException):
            pass
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def points(driver, canvas_id: str) -> int:
    """How many points the Chart.js chart on ``canvas_id`` holds in its first dataset."""
    return driver.execute_script(
        "const c = Chart.getChart(arguments[0]);"
        "return c && c.data.datasets.length ? c.data.datasets[0].data.length : 0;",
        canvas_id,
    )


def test_dashboard_shows_cancels_and_isolates_jobs(
    mesh, browser, letter_model_dir, tmp_path_factory
) -> None:
    from selenium.webdriver.common.by import By

    shots = tmp_path_factory.mktemp("dashboard-screenshots")
    base = mesh.dashboard_url.rstrip("/")

    # Another tenant's job: it exists, but the local user must never see it.
    bob = opentinker.Client(
        mesh.scheduler_address, api_key=other_tenant_key(mesh, "other-team", "bob"), timeout=10
    )
    hidden = bob.submit(letter_job(letter_model_dir, name="bobs-secret", steps=2))
    bob.cancel(hidden.job_id)

    # The local user's job, followed by a client writing jsonl and TensorBoard sinks.
    sink_dir = tmp_path_factory.mktemp("sinks")
    client = opentinker.Client(mesh.scheduler_address, api_key=mesh.api_key, timeout=10)
    spec = letter_job(letter_model_dir, name="watch-me", steps=400)
    sinks = [JsonlSink(sink_dir / "run.jsonl"), TensorBoardSink(sink_dir / "tb")]
    outcome: dict[str, object] = {}

    def follow() -> None:
        try:
            client.fit(spec, sinks=sinks, timeout=400)
        except JobFailedError as err:
            outcome["error"] = err

    follower = threading.Thread(target=follow, daemon=True)
    follower.start()
    job = wait_for(lambda: next(iter(client.list_jobs()), None), timeout=30, what="the job")

    # Sign in with the API key; the jobs page lists the user's job and not bob's.
    browser.get(base + "/")
    assert browser.current_url.endswith("/login")
    browser.find_element(By.ID, "api_key").send_keys(mesh.api_key)
    browser.find_element(By.ID, "sign-in").click()
    wait_for(lambda: browser.find_elements(By.ID, "jobs"), timeout=15, what="the jobs page")
    listed = {row.get_attribute("data-job-id") for row in
              browser.find_elements(By.CSS_SELECTOR, "#jobs tbody tr[data-job-id]")}  # fmt: skip
    assert job.job_id in listed and hidden.job_id not in listed, listed
    assert "bobs-secret" not in browser.page_source
    browser.save_screenshot(str(shots / "1-jobs.png"))

    # The job page's reward chart fills from the event stream and keeps growing, live.
    browser.get(f"{base}/jobs/{job.job_id}")
    first = wait_for(lambda: points(browser, "chart-0") >= 2, timeout=240, what="2 steps")
    assert first
    seen = points(browser, "chart-0")
    wait_for(lambda: points(browser, "chart-0") >= seen + 2, timeout=120, what="live steps")
    assert browser.find_element(By.ID, "job-state").text == "RUNNING"
    assert browser.find_element(By.ID, "job-attempt").text == "1"  # one lease so far
    browser.save_screenshot(str(shots / "2-job-live-charts.png"))

    # Workers, devices and leases: the user sees the lease of their job; bob sees the device
    # held but not by which job, nor that job's progress.
    browser.get(base + "/workers")
    assert job.job_id in browser.find_element(By.ID, "workers").text
    browser.save_screenshot(str(shots / "3-workers.png"))
    held = [d for w in bob.workers() for d in w.devices if d.leased]
    assert held and all(d.job_id == "" and d.lease_id == "" for d in held), held
    assert bob.jobs_progress([job.job_id]) == {}
    assert client.jobs_progress([job.job_id])[job.job_id].step >= seen
    with pytest.raises(InvalidArgumentError, match="at most 500"):
        client.jobs_progress([f"job-{i}" for i in range(501)])
    browser.get(base + "/")  # the jobs table shows the running job's last reward and step
    row = browser.find_element(By.CSS_SELECTOR, f'tr[data-job-id="{job.job_id}"]').text
    assert "RUNNING" in row and "—" not in row and "/400" in row, row

    # Cancel from the page: the scheduler cancels the job and the page shows it.
    browser.get(f"{base}/jobs/{job.job_id}")
    browser.find_element(By.ID, "cancel").click()
    browser.switch_to.alert.accept()
    wait_for(lambda: browser.find_element(By.ID, "job-state").text == "CANCELLED",
             timeout=60, what="the page to show CANCELLED")  # fmt: skip
    assert client.get_job(job.job_id).state == "CANCELLED"
    assert "dashboard" in client.get_job(job.job_id).reason
    browser.save_screenshot(str(shots / "4-job-cancelled.png"))

    # The event stream resumes after the event the browser names, sending nothing twice.
    cookie = browser.get_cookie("opentinker_session")["value"]
    resumed = urllib.request.Request(
        f"{base}/jobs/{job.job_id}/events",
        headers={"Cookie": f"opentinker_session={cookie}", "Last-Event-ID": "3"},
    )
    with urllib.request.urlopen(resumed, timeout=30) as stream:
        body = stream.read().decode()
    ids = [int(line[4:]) for line in body.splitlines() if line.startswith("id: ")]
    assert ids[0] == 4 and ids == list(range(4, 4 + len(ids))) and "event: end" in body

    # Bob's job is not there for the local user, by page or by event stream.
    browser.get(f"{base}/jobs/{hidden.job_id}")
    assert "bobs-secret" not in browser.page_source and "not found" in browser.page_source.lower()
    request = urllib.request.Request(
        f"{base}/jobs/{hidden.job_id}/events", headers={"Cookie": f"opentinker_session={cookie}"}
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 404

    browser.get(base + "/environments")
    assert "letter" in browser.find_element(By.ID, "environments").text
    browser.save_screenshot(str(shots / "5-environments.png"))

    # A wrong key gets the sign-in form back with the scheduler's reason, and no cookie.
    form = urllib.parse.urlencode({"api_key": "otk_not-a-key"}).encode()
    with urllib.request.urlopen(base + "/login", data=form, timeout=10) as page:
        assert b'id="login-error"' in page.read() and "set-cookie" not in page.headers

    # The CLI replays the run into sinks and draws it: tail (exit 1: CANCELLED) and plot.
    cli = [sys.executable, "-m", "opentinker", "--scheduler", mesh.scheduler_address]
    as_user = {**os.environ, "OPENTINKER_API_KEY": mesh.api_key, "WANDB_MODE": "offline"}
    tail = subprocess.run(
        [*cli, "tail", job.job_id, "--jsonl", "tail.jsonl", "--tensorboard", "tail-tb", "--wandb"],
        capture_output=True, text=True, timeout=120, env=as_user, cwd=sink_dir,
    )  # fmt: skip
    assert tail.returncode == 1 and "CANCELLED" in tail.stdout, tail.stdout + tail.stderr
    assert "reward" in tail.stdout and "ETA" in tail.stdout  # the live footer's last frame
    assert list((sink_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert list((sink_dir / "tail-tb").glob("events.out.tfevents.*"))
    replayed = (sink_dir / "tail.jsonl").read_text().splitlines()
    plot = subprocess.run([*cli, "plot", job.job_id, "-o", str(shots / "6-curves.png")],
                          capture_output=True, text=True, timeout=120, env=as_user)  # fmt: skip
    assert plot.returncode == 0, plot.stdout + plot.stderr
    assert (shots / "6-curves.png").read_bytes()[:4] == b"\x89PNG"

    # The client's sinks saw the same run through WatchJob.
    follower.join(timeout=30)
    assert isinstance(outcome.get("error"), JobFailedError)  # fit raises: CANCELLED
    rows = [json.loads(line) for line in (sink_dir / "run.jsonl").read_text().splitlines()]
    rewards = [r["metrics"]["reward_mean"] for r in rows if r["kind"] == "step"]
    assert len(rewards) >= seen + 2 and rows[-1]["state"] == "CANCELLED"
    assert [json.loads(line) for line in replayed] == rows  # the late tail: the same events
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reader = EventAccumulator(str(sink_dir / "tb"))
    reader.Reload()
    assert [s.value for s in reader.Scalars("reward_mean")] == pytest.approx(rewards)
    client.close()
    bob.close()
    print("dashboard screenshots:", *sorted(str(p) for p in shots.iterdir()), sep="\n  ")
