"""The dashboard over HTTP without a browser: a real scheduler process (no worker, so jobs
stay QUEUED), the dashboard app in-process, two tenants. Sign-in, isolation, cancel, and an
event stream that sends only events after the one the browser names."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import opentinker
from opentinker import JobSpec, RlConfig
from opentinker.admin import AdminClient
from opentinker.services.launcher.processes import ServiceProcess, free_port
from opentinker.services.scheduler.tenants.bootstrap import ADMIN_KEY_FILE

pytestmark = pytest.mark.integration


@pytest.fixture()
def scheduler(redis_url: str, tmp_path: Path):
    address = f"127.0.0.1:{free_port()}"
    proc = ServiceProcess.start(
        "scheduler",
        "opentinker.services.scheduler",
        env={
            "OPENTINKER_REDIS_URL": redis_url,
            "OPENTINKER_PORT": address.split(":")[1],
            "OPENTINKER_AUTH_SECRET_FILE": str(tmp_path / "auth.secret"),
            "OPENTINKER_BOOTSTRAP_DIR": str(tmp_path),
        },
        log_dir=tmp_path / "logs",
        address=address,
    )
    try:
        proc.wait_serving(timeout_s=60)
        yield address, (tmp_path / ADMIN_KEY_FILE).read_text().strip()
    finally:
        proc.stop()


def make_keys(address: str, admin_key: str) -> dict[str, str]:
    with AdminClient(address, api_key=admin_key) as admin:
        keys = {}
        for tenant, user in (("acme", "alice"), ("globex", "bob")):
            admin.create_tenant(tenant)
            admin.create_user(user, tenant_id=tenant)
            keys[user] = admin.create_api_key(user)
        return keys


def test_sign_in_isolation_cancel_and_resumed_events(scheduler) -> None:
    from starlette.testclient import TestClient

    from opentinker.services.dashboard.app import create_app
    from opentinker.services.dashboard.settings import DashboardSettings

    address, admin_key = scheduler
    keys = make_keys(address, admin_key)
    spec = JobSpec(name="queued", rl=RlConfig(env_name="letter", steps=3))
    jobs = {}
    for user, key in keys.items():
        with opentinker.Client(address, api_key=key) as client:
            jobs[user] = client.submit(spec.model_copy(update={"name": f"{user}-job"})).job_id

    settings = DashboardSettings(scheduler_address=address, envhub_address="127.0.0.1:1",
                                 stream_hold_s=1.0)  # fmt: skip
    with TestClient(create_app(settings), follow_redirects=False) as web:
        assert web.get("/").headers["location"] == "/login"  # nothing without a sign-in
        refused = web.post("/login", data={"api_key": "otk_nope_nope"})
        assert 'id="login-error"' in refused.text and "opentinker_session" not in web.cookies

        signed = web.post("/login", data={"api_key": keys["alice"]})
        assert signed.status_code == 303 and "opentinker_session" in web.cookies
        page = web.get("/").text
        assert jobs["alice"] in page and "alice-job" in page
        assert jobs["bob"] not in page and "bob-job" not in page

        # Bob's job does not exist for alice: page, events and cancel all say NOT_FOUND.
        assert web.get(f"/jobs/{jobs['bob']}").status_code == 404
        assert web.get(f"/jobs/{jobs['bob']}/events").status_code == 404
        assert web.post(f"/jobs/{jobs['bob']}/cancel").status_code == 404
        with opentinker.Client(address, api_key=keys["bob"]) as bob:
            assert bob.get_job(jobs["bob"]).state == "QUEUED"

        # The stream sends the events after the one named, then holds and ends (1 s here).
        first = web.get(f"/jobs/{jobs['alice']}/events?after=0").text
        assert "id: 1\nevent: job\n" in first and '"state": "QUEUED"' in first
        assert "id: " not in web.get(f"/jobs/{jobs['alice']}/events?after=1").text
        assert web.get(f"/jobs/{jobs['alice']}/events?after=x").status_code == 400

        assert web.post(f"/jobs/{jobs['alice']}/cancel").status_code == 303
        resumed = web.get(
            f"/jobs/{jobs['alice']}/events", headers={"Last-Event-ID": "1"}
        ).text  # the browser's reconnect: only the new event, then the end
        assert "id: 2\n" in resumed and '"CANCELLED"' in resumed and "event: end" in resumed
        assert "id: 1\n" not in resumed
        assert "no worker connected" in web.get("/workers").text

        web.post("/logout")
        assert web.get("/").status_code == 303


def test_a_key_revoked_while_signed_in_signs_the_browser_out(identities) -> None:
    from starlette.testclient import TestClient

    from opentinker.services.dashboard.app import create_app
    from opentinker.services.dashboard.settings import DashboardSettings

    with AdminClient(identities.scheduler_address, api_key=identities.admin_key) as admin:
        key = admin.create_api_key("alice", label="dashboard-revoked")
        settings = DashboardSettings(
            scheduler_address=identities.scheduler_address, envhub_address="127.0.0.1:1"
        )
        with TestClient(create_app(settings), follow_redirects=False) as web:
            assert web.post("/login", data={"api_key": key}).status_code == 303
            assert web.get("/").status_code == 200
            envs = web.get("/environments")  # no EnvHub at 127.0.0.1:1: said, not a 500
            assert envs.status_code == 503 and "EnvHub at 127.0.0.1:1" in envs.text, envs.text
            admin.revoke_api_key(key.split("_")[1])

            # Not a 500: the sign-in is dropped and the page says why and what to do.
            page = web.get("/")
            assert page.status_code == 401 and 'id="login-error"' in page.text, page.text
            assert "sign in again" in page.text and "opentinker_session" not in web.cookies
            assert web.get("/jobs/job-x/events").status_code in (303, 401)


def test_a_scheduler_away_is_a_503_naming_it_not_a_500() -> None:
    from starlette.testclient import TestClient

    from opentinker.services.dashboard.app import create_app
    from opentinker.services.dashboard.settings import DashboardSettings

    away = f"127.0.0.1:{free_port()}"  # nothing listens there
    settings = DashboardSettings(scheduler_address=away, envhub_address="127.0.0.1:1")
    with TestClient(create_app(settings), follow_redirects=False) as web:
        page = web.post("/login", data={"api_key": "otk_abc_def"})
        assert page.status_code == 503 and 'id="login-error"' in page.text, page.text
        assert away in page.text and "opentinker_session" not in web.cookies


def test_cancelling_an_ended_job_or_a_bad_event_number_says_why(identities) -> None:
    from starlette.testclient import TestClient

    from opentinker.services.dashboard.app import create_app
    from opentinker.services.dashboard.settings import DashboardSettings

    spec = JobSpec(name="twice-cancelled", rl=RlConfig(env_name="letter", steps=3))
    with opentinker.Client(identities.scheduler_address, api_key=identities.user_key) as client:
        job_id = client.submit(spec).job_id
    settings = DashboardSettings(
        scheduler_address=identities.scheduler_address, envhub_address="127.0.0.1:1"
    )
    with TestClient(create_app(settings), follow_redirects=False) as web:
        web.post("/login", data={"api_key": identities.user_key})
        assert web.post(f"/jobs/{job_id}/cancel").status_code == 303
        again = web.post(f"/jobs/{job_id}/cancel")  # a second click: the job has ended
        assert again.status_code == 409 and "already ended" in again.text, again.text
        for after in ("²", "9" * 30):  # a digit that int() refuses; past int64
            answer = web.get(f"/jobs/{job_id}/events", params={"after": after})
            assert answer.status_code == 400 and "event number" in answer.text, answer.text


def test_sign_ins_left_idle_are_closed_without_being_visited_again(identities) -> None:
    """A browser closed without signing out never sends its cookie again: its sign-in (a
    scheduler channel) must still be closed once idle, not kept for the process's life."""
    import time

    from opentinker.services.dashboard.sessions import SignIns

    sign_ins = SignIns(
        scheduler_address=identities.scheduler_address, ca_file=None, timeout_s=5, idle_s=0.5
    )
    try:
        _, left = sign_ins.sign_in(identities.user_key)  # the browser that went away
        assert left.client.whoami().user_id == "alice"
        time.sleep(1.0)
        token, fresh = sign_ins.sign_in(identities.user_key)  # anyone else signing in
        assert sign_ins.get(token) is fresh
        with pytest.raises(ValueError, match="closed channel"):
            left.client.whoami()  # its channel was closed with it
    finally:
        sign_ins.close()


def _strict_json(text: str) -> object:
    """``text`` as a browser's JSON.parse reads it: NaN and Infinity are not JSON there."""

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is not JSON (JSON.parse throws on it)")

    return json.loads(text, parse_constant=refuse)


def test_a_step_with_a_nan_metric_reaches_the_page_as_json(scheduler, redis_url) -> None:
    """A diverged step (loss NaN, a ratio inf) is what the charts must show, not a message
    the page's JSON.parse throws on (and so drops): non-finite numbers are sent as null."""
    import asyncio

    import redis.asyncio as aioredis
    from starlette.testclient import TestClient

    from opentinker.common.v1 import common_pb2
    from opentinker.services.dashboard.app import create_app
    from opentinker.services.dashboard.settings import DashboardSettings
    from opentinker.services.scheduler.jobs.event_log import RedisEventLog

    address, admin_key = scheduler
    key = make_keys(address, admin_key)["alice"]
    with opentinker.Client(address, api_key=key) as client:
        job_id = client.submit(JobSpec(name="diverged", rl=RlConfig(env_name="letter"))).job_id

    async def report_step() -> None:  # as the scheduler stores a job's reported step
        r = aioredis.Redis.from_url(redis_url)
        step = common_pb2.StepMetrics(step=1, metrics={"loss": math.nan, "ratio": math.inf,
                                                       "reward_mean": 0.5})  # fmt: skip
        await RedisEventLog(r).append(job_id, common_pb2.JobEvent(step=step))
        await r.aclose()

    asyncio.run(report_step())
    settings = DashboardSettings(scheduler_address=address, envhub_address="127.0.0.1:1",
                                 stream_hold_s=1.0)  # fmt: skip
    with TestClient(create_app(settings), follow_redirects=False) as web:
        web.post("/login", data={"api_key": key})
        stream = web.get(f"/jobs/{job_id}/events?after=1").text
    data = [line[len("data: ") :] for line in stream.splitlines() if line.startswith("data: ")]
    assert len(data) == 1, stream
    event = _strict_json(data[0])
    assert isinstance(event, dict) and event["step"] == 1
    assert event["metrics"] == {"loss": None, "ratio": None, "reward_mean": 0.5}


def test_open_event_streams_leave_the_pages_answering(identities) -> None:
    """Each open job page holds its event stream for ``stream_hold_s``, blocked in a thread
    until the next event; as many as the thread pool has threads (40) must not leave every
    other page of every tenant waiting for one."""
    import threading
    import time

    from starlette.testclient import TestClient

    from opentinker.services.dashboard.app import create_app
    from opentinker.services.dashboard.settings import DashboardSettings

    spec = JobSpec(name="watched", rl=RlConfig(env_name="letter", steps=3))
    with opentinker.Client(identities.scheduler_address, api_key=identities.user_key) as client:
        job_id = client.submit(spec).job_id  # QUEUED: no event after the first
    settings = DashboardSettings(scheduler_address=identities.scheduler_address,
                                 envhub_address="127.0.0.1:1", stream_hold_s=8.0)  # fmt: skip
    with TestClient(create_app(settings), follow_redirects=False) as web:
        web.post("/login", data={"api_key": identities.user_key})
        viewers = [
            threading.Thread(target=web.get, args=(f"/jobs/{job_id}/events?after=1",))
            for _ in range(40)
        ]
        for viewer in viewers:
            viewer.start()
        time.sleep(2.0)  # every stream open and waiting
        started = time.monotonic()
        page = web.get("/")
        elapsed = time.monotonic() - started
        for viewer in viewers:
            viewer.join(timeout=30)
    assert page.status_code == 200 and job_id in page.text
    assert elapsed < 3.0, f"the jobs page waited {elapsed:.1f} s behind the open streams"
