"""deploy/kubernetes/: every manifest is valid Kubernetes (checked offline against the
schemas kubernetes-validate ships), and agrees with akv: each pod's environment, resolved as
Kubernetes would resolve it, is a configuration akv accepts, with the ranks, ports,
addresses and paths the manifests say; and the Dockerfile builds what they run."""

from __future__ import annotations

import ast
import re
import shlex
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from akv.cluster import config as _config
from akv.cluster.roles import config_from_args, role_parser
from akv.errors import ConfigError

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="pip install kubernetes-validate (the test extra has it)"
)
yaml = pytest.importorskip("yaml", reason="PyYAML comes with kubernetes-validate")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy" / "kubernetes"
#: The Kubernetes versions the manifests are checked against: the oldest and the newest
#: whose schemas kubernetes-validate ships (1.25 and 1.37 in its 1.37; Indexed Jobs are GA
#: from 1.24).
VERSIONS = sorted(
    {kubernetes_validate.utils.all_versions()[0], kubernetes_validate.latest_version()}
)
POD_IP = "10.1.2.3"
TOKEN = "k" * 40


def documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    return docs


def one(kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_valid_kubernetes_offline(version):
    docs = documents()
    kinds = sorted(doc["kind"] for doc in docs)
    assert kinds == [
        "ConfigMap",
        "Job",
        "Secret",
        "Service",
        "Service",
        "StatefulSet",
        "StatefulSet",
    ]
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)  # raises on any error


def test_the_validator_does_catch_a_wrong_manifest():
    job = one("Job", "akv-workers")
    wrong = {**job, "spec": {**job["spec"], "completionMode": "Indexed", "complitions": 2}}
    with pytest.raises(kubernetes_validate.ValidationError, match="complitions"):
        kubernetes_validate.validate(wrong, VERSIONS[-1], strict=True)


# ------------------------------------------------------------------ pods as Kubernetes runs them


def pod_env(pod: Mapping[str, Any], container: Mapping[str, Any], facts: Mapping[str, str]):
    """A container's environment as Kubernetes makes it: the ConfigMaps of ``envFrom``, then
    ``env`` (the Secret's token, fields of the downward API from ``facts``), plus what
    Kubernetes sets itself (``HOSTNAME``, ``JOB_COMPLETION_INDEX``) from ``facts``."""
    env = {name: facts[name] for name in ("HOSTNAME", "JOB_COMPLETION_INDEX") if name in facts}
    for source in container.get("envFrom", []):
        env.update(one("ConfigMap", source["configMapRef"]["name"])["data"])
    for variable in container.get("env", []):
        if "value" in variable:
            env[variable["name"]] = variable["value"]
            continue
        source = variable["valueFrom"]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            assert ref["key"] in one("Secret", ref["name"])["stringData"]
            env[variable["name"]] = TOKEN  # what the user puts there
        else:
            env[variable["name"]] = facts[source["fieldRef"]["fieldPath"]]
    return env


def expand(words: list[str], env: Mapping[str, str]) -> list[str]:
    """``$(NAME)`` in a command, expanded as Kubernetes expands it."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], word) for word in words]


def container_of(workload: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    pod = workload["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    return pod, container


def port_named(container: Mapping[str, Any], name: str) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return int(port)


def probes_use_health_endpoints(container: Mapping[str, Any]) -> None:
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        assert container[probe]["httpGet"] == {"path": path, "port": "http"}


def test_the_scheduler_pod_listens_where_its_service_and_every_pod_say():
    service, workload = one("Service", "akv-scheduler"), one("StatefulSet", "akv-scheduler")
    pod, container = container_of(workload)
    env = pod_env(pod, container, {"HOSTNAME": "akv-scheduler-0"})
    command = expand(container["command"], env)
    assert command[0] == "akv-scheduler"
    args = role_parser("scheduler", "").parse_args(command[1:])
    config = config_from_args("scheduler", args, env)
    (port,) = service["spec"]["ports"]
    assert config.scheduler_port == port_named(container, "http") == port["port"]
    assert port["targetPort"] == "http"
    assert config.scheduler_host == "0.0.0.0"
    assert env["AKV_SCHEDULER_HOST"] == service["metadata"]["name"]  # what the others use
    assert workload["spec"]["replicas"] == 1
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == pod["metadata"]["labels"]
    probes_use_health_endpoints(container)


def test_each_server_pods_ordinal_is_its_rank_and_it_advertises_its_pod_ip():
    service, workload = one("Service", "akv-servers"), one("StatefulSet", "akv-server")
    pod, container = container_of(workload)
    spec = workload["spec"]
    assert spec["serviceName"] == service["metadata"]["name"]
    assert spec["podManagementPolicy"] == "Parallel"  # all must run for any to be ready
    (mount,) = container["volumeMounts"]
    assert [t["metadata"]["name"] for t in spec["volumeClaimTemplates"]] == [mount["name"]]
    for ordinal in range(spec["replicas"]):
        name = f"{workload['metadata']['name']}-{ordinal}"
        env = pod_env(pod, container, {"HOSTNAME": name, "status.podIP": POD_IP})
        command = expand(container["command"], env)
        assert command[0] == "akv-server"
        config = config_from_args("server", role_parser("server", "").parse_args(command[1:]), env)
        assert config.rank == ordinal
        assert config.advertised(config.port) == (POD_IP, port_named(container, "http"))
        assert config.checkpoint_dir == mount["mountPath"]
        assert config.num_servers == spec["replicas"]
    assert service["spec"]["clusterIP"] == "None"
    probes_use_health_endpoints(container)


def test_each_worker_pods_completion_index_is_its_rank():
    workload = one("Job", "akv-workers")
    spec = workload["spec"]
    pod, container = container_of(workload)
    assert (spec["completionMode"], spec["backoffLimit"]) == ("Indexed", 0)
    assert pod["spec"]["restartPolicy"] == "Never"
    assert spec["completions"] == spec["parallelism"]
    scheduler = one("Service", "akv-scheduler")
    for index in range(spec["completions"]):
        facts = {"HOSTNAME": f"akv-workers-{index}-x7k2p", "JOB_COMPLETION_INDEX": str(index)}
        config = _config.from_env(pod_env(pod, container, facts))
        assert (config.role, config.rank, config.num_workers) == (
            "worker",
            index,
            spec["completions"],
        )
        assert config.scheduler_host == scheduler["metadata"]["name"]
        assert config.scheduler_port == scheduler["spec"]["ports"][0]["port"]


def test_the_placeholder_token_is_refused_with_how_to_make_one():
    placeholder = one("Secret", "akv-token")["stringData"]["token"]
    workload = one("Job", "akv-workers")
    pod, container = container_of(workload)
    env = {**pod_env(pod, container, {"JOB_COMPLETION_INDEX": "0"}), "AKV_TOKEN": placeholder}
    with pytest.raises(ConfigError, match=r"AKV_TOKEN is too short .*secrets.token_hex\(32\)"):
        _config.from_env(env)


def _variables(node: Any) -> Iterator[str]:
    """Every environment variable name a manifest sets (env entries and ConfigMap keys)."""
    if isinstance(node, dict):
        if node.get("kind") == "ConfigMap":
            yield from node["data"]
        for key, value in node.items():
            if key == "env":
                yield from (variable["name"] for variable in value)
            else:
                yield from _variables(value)
    elif isinstance(node, list):
        for item in node:
            yield from _variables(item)


def _names_akv_reads() -> set[str]:
    """The AKV_*/DMLC_*/MXNET_* names in akv's source (the string constants)."""
    names = set()
    for path in (ROOT / "akv").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.update(re.findall(r"\b(?:AKV|DMLC|MXNET)_[A-Z0-9_]+\b", node.value))
    return names


def test_every_akv_variable_the_manifests_set_is_one_akv_reads():
    set_here = set(_variables(documents()))
    ours = {name for name in set_here if re.match(r"(AKV|DMLC|MXNET)_", name)}
    assert ours - _names_akv_reads() == set()
    config_keys = set(one("ConfigMap", "akv-job")["data"])
    for names in _config.JOB_VARIABLES:
        if names[0] != "AKV_ROLE":  # each workload says its role (the servers' command)
            assert names[0] in config_keys
    assert {"AKV_RANK_FROM", "AKV_ROLE", "AKV_TOKEN"} <= set_here
    assert _config.RANK_FROM_VARIABLE == "AKV_RANK_FROM"
    assert "JOB_COMPLETION_INDEX" in _config.RANK_SOURCES


def test_the_sizes_agree_with_the_job_config():
    data = one("ConfigMap", "akv-job")["data"]
    assert int(data["AKV_NUM_SERVERS"]) == one("StatefulSet", "akv-server")["spec"]["replicas"]
    assert int(data["AKV_NUM_WORKERS"]) == one("Job", "akv-workers")["spec"]["completions"]


def test_the_dockerfile_builds_the_image_the_manifests_run():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    lines = [line for line in dockerfile.splitlines() if line and not line.startswith("#")]
    assert lines[0] == "FROM python:3.11-slim"
    assert 'pip install "/src[examples]"' in dockerfile
    tag = re.search(r"docker build -f deploy/kubernetes/Dockerfile -t (\S+) \.", dockerfile)
    assert tag is not None
    copied = {}
    for line in lines:
        if line.startswith("COPY "):
            source, target = shlex.split(line)[1:]
            assert (ROOT / source).exists(), source
            copied[target] = source
    scripts = (ROOT / "pyproject.toml").read_text()
    for workload in documents():
        if workload["kind"] not in ("StatefulSet", "Job"):
            continue
        _, container = container_of(workload)
        assert container["image"] == tag.group(1)
        program = container["command"][0]
        if program == "python":  # a file the image carries
            path = Path(container["command"][1])
            assert copied[str(path.parent)] == "examples"
            assert (ROOT / "examples" / path.name).exists()
        else:
            assert f"\n{program} = " in scripts, program


def test_the_docs_scrape_configuration_finds_akvs_pods_with_the_token():
    text = (ROOT / "docs" / "kubernetes.md").read_text()
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, flags=re.S)]
    scrape = next(b for b in blocks if "scrape_configs" in b)["scrape_configs"][0]
    assert scrape["authorization"]["type"] == "Bearer"
    keep = {
        r["source_labels"][0]: r["regex"]
        for r in scrape["relabel_configs"]
        if r.get("action") == "keep"
    }
    labels = {
        d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
        for d in documents()
        if "template" in d.get("spec", {})
    }
    assert keep["__meta_kubernetes_pod_label_app_kubernetes_io_name"] in labels
    scraped = {
        p["name"]
        for d in documents()
        if d["kind"] == "StatefulSet"
        for p in container_of(d)[1]["ports"]
    }
    assert scraped <= set(keep["__meta_kubernetes_pod_container_port_name"].split("|"))
    monitor = next(b for b in blocks if b.get("kind") == "PodMonitor")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in scraped and endpoint["path"] == "/metrics"
    secret = endpoint["authorization"]["credentials"]
    assert secret["key"] in one("Secret", secret["name"])["stringData"]
    assert monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] in labels
