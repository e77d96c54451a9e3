"""A real Prometheus server scrapes a running worker; every metric the rules and the dashboard use is exported."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.redis_server import free_port
from tests.integration.worker_harness import chat, send_and_collect
from tests.unit.ops.test_ops_config import ALERTS, alert_rules, dashboard_exprs, metric_identifiers

pytestmark = pytest.mark.integration


def query(port: int, promql: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def exported_names(metrics_text: str) -> set[str]:
    names = set()
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            names.add(sample.name)
    return names


def test_prometheus_scrapes_the_worker_and_rules_and_panels_use_exported_metrics(
        worker_setup, kafka_bootstrap, tmp_path):
    prometheus = shutil.which("prometheus")
    assert prometheus, "the prometheus server is missing: apt-get install prometheus (ops/dev.sh does)"
    topics, start = worker_setup
    w = start()
    w.wait_ready()
    reqs = [chat(f"p{i}") for i in range(6)]
    got = asyncio.run(send_and_collect(kafka_bootstrap, topics, [(topics.chat, r, "json") for r in reqs],
                                       [r.id for r in reqs], linger=0.5))
    assert len(got) == 6

    # Every metric name a rule or a dashboard panel uses appears in the live exposition.
    live = exported_names(w.metrics())
    used = set()
    for rule in alert_rules():
        used |= metric_identifiers(rule["expr"])
    for expr in dashboard_exprs():
        used |= metric_identifiers(expr)
    missing = sorted(name for name in used if name not in live)
    assert not missing, f"used by rules or panels but not exported by a live worker: {missing}"

    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [{"job_name": "infinilm-worker", "static_configs": [{"targets": [f"127.0.0.1:{w.port}"]}]}],
    }))
    proc = subprocess.Popen([prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        series: list[dict] = []
        while time.monotonic() < deadline:
            try:
                series = query(port, 'infinilm_requests_total{job="infinilm-worker",kind="chat",status="ok"}')
                if series and float(series[0]["value"][1]) >= 6:
                    break
            except OSError:
                pass
            time.sleep(1)
        assert series and float(series[0]["value"][1]) >= 6, series
        names = {s["metric"]["__name__"] for s in query(port, '{__name__=~"infinilm_.+"}')}
        for expected in ("infinilm_batch_utilization", "infinilm_kv_cache_hit_rate", "infinilm_pipeline_stall_bucket",
                         "infinilm_time_to_first_token_seconds_bucket", "infinilm_redis_up"):
            assert expected in names
        assert query(port, 'up{job="infinilm-worker"}')[0]["value"][1] == "1"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/rules", timeout=5) as resp:
            groups = json.loads(resp.read())["data"]["groups"]
        loaded = {r["name"] for g in groups for r in g["rules"]}
        assert "HighPipelineStall" in loaded
    finally:
        proc.terminate()
        proc.wait(20)
