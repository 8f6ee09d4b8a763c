"""Usage accounting per tenant: the meter's split, the bill's arithmetic, and a real stack whose
services report what two tenants used (an SFT and an RL job) and whose bill reconciles with
the services' own busy time; ``joynexus top`` draws the same stack."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.usage import as_document, parse_since, render
from bus.connect import connect
from bus.declare import declare
from bus.server import EmbeddedServer
from bus.usage import Bill, UsageMeter, UsageReporter, _report, read_bill
from clients.sdk import Client
from tests.conftest import Procs
from tests.helpers import joynexus, print_log_tails, start_service, uid
from tests.sft_helpers import OFT_2D, record_datasets, registered, sft_spec
from tests.test_rl import rl_spec


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


def prometheus_value(text: str, name: str) -> float:
    """The sum of ``name``'s samples in a Prometheus text page."""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    ]
    assert values, f"{name} not in the page"
    return sum(values)


def test_a_shared_forward_is_split_by_each_tenants_share_and_kept_when_unreported() -> None:
    meter = UsageMeter(period_start=100.0)
    meter.split(3.0, {("a", "j1"): 8, ("b", "j2"): 16})
    meter.split(1.0, {})  # nothing shared: nobody is charged
    meter.charge("a", "j1", samples=8, checkpoint_bytes=1000)
    start, taken = meter.take(200.0)
    assert start == 100.0 and meter.period_start == 200.0 and not meter.jobs
    a, b = taken[("a", "j1")], taken[("b", "j2")]
    assert a.compute_s == pytest.approx(1.0) and b.compute_s == pytest.approx(2.0)
    assert (a.samples, a.checkpoint_bytes, b.samples) == (8, 1000, 0)
    meter.charge("b", "j2", act_requests=2, observations=8)
    meter.give_back(start, taken)  # the broker did not take the report: merged into the next
    _, merged = meter.take(300.0)
    assert merged[("b", "j2")].compute_s == pytest.approx(2.0)
    assert merged[("b", "j2")].act_requests == 2


def test_a_bill_adds_reports_per_tenant_and_service_and_checks_them() -> None:
    meter = UsageMeter(period_start=0.0)
    meter.split(4.0, {("a", "j1"): 1, ("b", "j2"): 3})
    bill = Bill()
    bill.add(_report("trainer", "t-1", 1, 0.0, 10.0, 4.0, meter.take(10.0)[1]))
    meter.charge("a", "j3", compute_s=0.5, env_steps=40)
    bill.add(_report("envs", "e-1", 1, 0.0, 10.0, 0.5, meter.take(10.0)[1]))
    document = as_document(bill, {"a": 2_000_000}, None, None)
    assert document["services"] == {
        "envs": {"busy_s": 0.5, "charged_s": 0.5},
        "trainer": {"busy_s": 4.0, "charged_s": 4.0},
    }
    a = document["tenants"]["a"]
    assert a["services"]["trainer"]["compute_s"] == pytest.approx(1.0)
    assert a["services"]["envs"]["env_steps"] == 40 and a["checkpoint_bytes_stored"] == 2_000_000
    assert a["jobs"]["j1"]["trainer"]["compute_s"] == pytest.approx(1.0)
    assert a["jobs"]["j3"]["envs"]["env_steps"] == 40 and set(a["jobs"]) == {"j1", "j3"}
    text = render(document)
    assert "a                      trainer" in text and "25.0%" in text and "100.0%" in text
    assert "a                      j3 envs" in render(document, by_job=True)
    only_b = as_document(bill, {}, None, "b")
    assert list(only_b["tenants"]) == ["b"]


def test_since_takes_a_duration_or_a_date_and_names_what_it_takes() -> None:
    assert parse_since("30m", now=10_000.0) == 8_200.0
    assert parse_since("2026-12-03T00:00") == parse_since("2026-12-03T00:00+00:00")
    with pytest.raises(ValueError, match=r"--since 'yesterday': give a duration"):
        parse_since("yesterday")


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[EmbeddedServer]:
    """A server of this test's own: its USAGE stream holds only this test's reports."""
    server = EmbeddedServer(tmp_path / "nats").start()
    yield server
    server.stop()


@pytest.mark.timeout(300)
async def test_two_tenants_usage_is_reported_and_reconciles_with_the_services_busy_time(
    own_server: EmbeddedServer, procs: Procs, tmp_path: Path
) -> None:
    url = own_server.url
    logs = tmp_path / "logs"
    logs.mkdir()
    roles = {}
    ports = {role: free_port() for role in ("master", "envs", "inferencer", "trainer")}
    for role, port in ports.items():
        args = ["--deterministic"] if role == "trainer" else []
        roles[role] = procs.add(
            start_service(
                role,
                url,
                logs / f"{role}.log",
                *args,
                JOYNEXUS_USAGE_REPORT_S="1",
                JOYNEXUS_METRICS_PORT=str(port),
            )
        )
    datasets = record_datasets(tmp_path / "datasets")
    sft_tenant, rl_tenant = uid("bill-sft"), uid("bill-rl")
    nc = await connect(url, name="test-usage")
    js = nc.jetstream()
    try:
        await declare(js)
        spec = sft_spec(sft_tenant, await registered(js, sft_tenant, datasets["reach"]), OFT_2D, 10)
        async with await Client.connect(url) as client:
            sft_job, rl_job = await asyncio.gather(
                client.train_sft(spec), client.train_rl(rl_spec(rl_tenant, iterations=1))
            )
            assert (await sft_job.wait(180)).status == "succeeded"
            assert (await rl_job.wait(180)).status == "succeeded"
        top = await joynexus("top", "--url", url, "--once", env={**os.environ, "COLUMNS": "200"})
        print(top.stdout)
        assert top.returncode == 0, top.stderr
        for shown in (sft_job.job_id, rl_job.job_id, "10/10", "1/1", "succeeded", "inferencer"):
            assert shown in top.stdout, shown
        assert "%" in top.stdout  # the roles' utilisation over the frame's interval
        scraped = {
            role: await asyncio.to_thread(scrape, f"http://127.0.0.1:{port}/metrics")
            for role, port in ports.items()
        }
        # A clean stop reports what was charged since the last report.
        for proc in roles.values():
            proc.send_signal(signal.SIGTERM)
        assert [await asyncio.to_thread(p.wait, 30) for p in roles.values()] == [0, 0, 0, 0]
        bill = await read_bill(js)
    except BaseException:
        print_log_tails(logs)
        raise
    finally:
        await nc.close()

    sft = bill.of(sft_tenant)
    assert set(sft) == {"trainer"}  # streaming a dataset runs no simulator, asks no inferencer
    assert bill.jobs_of(sft_tenant) == {sft_job.job_id: sft}  # one job: its lines are the same
    assert sft["trainer"].samples == 10 * 8 and sft["trainer"].compute_s > 0
    assert sft["trainer"].checkpoint_bytes > 0
    rl = bill.of(rl_tenant)
    assert set(rl) == {"trainer", "inferencer", "envs"}
    assert rl["envs"].env_steps > 0 and rl["envs"].compute_s > 0
    assert rl["inferencer"].act_requests > 0 and rl["inferencer"].observations >= 8
    assert rl["trainer"].samples > 0 and rl["trainer"].checkpoint_bytes > 0
    # Reconciled: what the tenants were charged is what each service measured itself.
    for service in ("trainer", "inferencer", "envs"):
        charged = bill.charged_s()[service]
        assert charged == pytest.approx(bill.busy_s[service], rel=1e-6, abs=1e-9), service
        assert bill.busy_s[service] > 0

    # The same measurements through the OpenTelemetry metrics API, on Prometheus endpoints.
    for role, text in scraped.items():
        assert f'joynexus_role="{role}"' in text, role
        assert "joynexus_service_held_seconds_total{" in text, role
    for role in ("trainer", "inferencer", "envs"):
        busy = prometheus_value(scraped[role], "joynexus_service_busy_seconds_total")
        assert busy > 0, role
    assert prometheus_value(scraped["trainer"], "joynexus_trainer_samples_total") >= 80 + 1
    assert f'joynexus_tenant="{rl_tenant}"' in scraped["inferencer"]
    assert prometheus_value(scraped["inferencer"], "joynexus_act_latency_seconds_count") > 0

    out = await joynexus("usage", "--url", url, "--json")
    assert out.returncode == 0, out.stderr
    document = json.loads(out.stdout)
    assert document["tenants"][sft_tenant]["services"]["trainer"]["samples"] == 80
    assert document["tenants"][sft_tenant]["checkpoint_bytes_stored"] > 0
    table = await joynexus("usage", "--url", url, "--tenant", rl_tenant)
    print(out.stdout, table.stdout)
    assert table.returncode == 0, table.stderr
    assert rl_tenant in table.stdout and sft_tenant not in table.stdout


async def test_a_restarted_role_of_the_same_instance_name_is_billed_for_its_first_reports(
    tmp_path: Path,
) -> None:
    """A container restarted in place keeps its hostname and pid 1, so its instance name,
    and counts reports from 1 again: the server took its first reports for duplicates of
    the last run's (the same msg ids within the duplicate window) and dropped them."""
    server = EmbeddedServer(tmp_path / "nats").start()
    nc = await connect(server.url)
    try:
        js = nc.jetstream()
        await declare(js)
        tenant = uid("acme")
        for run in range(2):  # the role, then its restart
            meter = UsageMeter()
            meter.charge(tenant, "j1", samples=10 + run)
            reporter = UsageReporter(js, "trainer", "trainer-host-1", meter, lambda: 0.0)
            await reporter.report()
            assert reporter.seq == 1
        bill = await read_bill(js, tenant=tenant)
        assert bill.reports == 2
        assert bill.by_job[(tenant, "j1", "trainer")].samples == 21
    finally:
        await nc.close()
        server.kill()
