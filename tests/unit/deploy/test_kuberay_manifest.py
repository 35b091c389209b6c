"""deploy/kuberay/rayservice.yaml: a RayService KubeRay accepts (structure),
whose embedded Serve config passes Ray Serve's own schema and builds our
real application, with every secret from a Kubernetes Secret."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml

MANIFEST = Path(__file__).resolve().parents[3] / "deploy" / "kuberay" / "rayservice.yaml"
SECRET_NAME = "pdcluster-secrets"


@pytest.fixture(scope="module")
def documents() -> list[dict]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


@pytest.fixture(scope="module")
def rayservice(documents) -> dict:
    [service] = [d for d in documents if d["kind"] == "RayService"]
    return service


@pytest.fixture(scope="module")
def serve_config(rayservice) -> dict:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


def _containers(rayservice: dict) -> dict[str, dict]:
    """group name ("head" for the head) -> its one Ray container."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    groups = {"head": cluster["headGroupSpec"], **{g["groupName"]: g for g in cluster["workerGroupSpecs"]}}
    return {name: group["template"]["spec"]["containers"][0] for name, group in groups.items()}


def _secret_env(container: dict) -> dict[str, str]:
    return {e["name"]: e["valueFrom"]["secretKeyRef"]["key"] for e in container.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})}


def test_every_document_has_kubernetes_identity(documents):
    kinds = sorted(d["kind"] for d in documents)
    assert kinds == ["Deployment", "RayService", "Service"]
    for d in documents:
        assert d["apiVersion"] and d["metadata"]["name"]


def test_rayservice_structure(rayservice):
    assert rayservice["apiVersion"] == "ray.io/v1"
    spec = rayservice["spec"]
    assert isinstance(spec["serveConfigV2"], str)  # KubeRay takes it as a YAML string
    cluster = spec["rayClusterConfig"]
    import ray
    assert cluster["rayVersion"] == ray.__version__  # the image's Ray must be the one we test with
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["labels"] == "pdcluster/role=head"
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    for name, group in groups.items():
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        assert group["rayStartParams"]["labels"] == f"pdcluster/role={name}"
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())  # KubeRay wants strings
    for name, container in _containers(rayservice).items():
        assert container["image"], name
        resources = container["resources"]
        assert resources["requests"]["cpu"] and resources["limits"]["memory"], name


def test_serve_config_passes_ray_serve_schema(serve_config):
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(serve_config)
    [app] = schema.applications
    assert app.import_path == "pdcluster.services.app:app_builder"


def test_import_path_is_our_app_builder(serve_config):
    module, attr = serve_config["applications"][0]["import_path"].split(":")
    from pdcluster.services.app import app_builder

    assert getattr(importlib.import_module(module), attr) is app_builder


def test_args_build_the_application(serve_config, monkeypatch):
    """The args validate as our ClusterConfig (with the Secret-provided env),
    and each pool lands on the worker group its labels name."""
    from ray.serve import Application

    from pdcluster.services.app import app_builder, build_app
    from pdcluster.services.config import ClusterConfig

    monkeypatch.setenv("PDCLUSTER_API_KEY", "test-key-from-secret")
    monkeypatch.setenv("REDIS_URL", "redis://:pw@pdcluster-redis:6379/0")
    args = serve_config["applications"][0]["args"]
    config = ClusterConfig.model_validate(args)
    assert config.topology.internal_host == "node" and config.api_key_digests
    assert not config.topology.allow_transfer_fallback
    assert config.topology.actor_options("prefill") == {"label_selector": {"pdcluster/role": "prefill"}}
    assert config.topology.actor_options("decode") == {"label_selector": {"pdcluster/role": "decode"}}
    assert isinstance(app_builder(args), Application)
    assert isinstance(build_app(config), Application)


def test_args_without_redis_password_are_refused(serve_config, monkeypatch):
    from pdcluster.services.config import ClusterConfig

    monkeypatch.setenv("PDCLUSTER_API_KEY", "test-key-from-secret")
    args = {**serve_config["applications"][0]["args"], "index_url": "redis://pdcluster-redis:6379/0"}
    with pytest.raises(ValueError, match="give index_url a password"):
        ClusterConfig.model_validate(args)


def test_secrets_come_from_kubernetes_secrets(rayservice, documents):
    """Every pod holds the cluster secret and the Redis URL; only the head
    (where the app builder digests it) holds the API key; Redis's password
    too comes from the Secret.  No secret value is written in the manifest."""
    for name, container in _containers(rayservice).items():
        env = _secret_env(container)
        assert env["PDCLUSTER_CLUSTER_SECRET"] == "cluster-secret", name
        assert env["REDIS_URL"] == "redis-url", name
        assert env["RAY_AUTH_TOKEN"] == "ray-auth-token", name  # a worker joins only with the head's token
        assert ("PDCLUSTER_API_KEY" in env) == (name == "head"), name
        refs = {e["valueFrom"]["secretKeyRef"]["name"] for e in container["env"] if "valueFrom" in e}
        assert refs == {SECRET_NAME}
    [redis] = [d for d in documents if d["kind"] == "Deployment"]
    redis_container = redis["spec"]["template"]["spec"]["containers"][0]
    assert "--requirepass" in redis_container["args"]
    assert _secret_env(redis_container) == {"REDIS_PASSWORD": "redis-password"}
    assert "runtime_env" not in rayservice["spec"]["serveConfigV2"]  # Ray logs runtime_env


def test_redis_service_selects_the_redis_deployment(documents):
    [redis] = [d for d in documents if d["kind"] == "Deployment"]
    [service] = [d for d in documents if d["kind"] == "Service"]
    labels = redis["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["port"] == 6379


def test_the_head_is_ready_when_a_request_would_succeed(rayservice):
    head = _containers(rayservice)["head"]
    probe = head["readinessProbe"]["httpGet"]
    assert probe["path"] == "/ready"
    assert probe["port"] in {p["name"] for p in head["ports"]} and "serve" == probe["port"]


def test_the_head_drains_before_it_stops(rayservice):
    head_pod = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    command = head_pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["pdcluster", "drain"]
    drain_s = float(command[command.index("--timeout") + 1])
    assert head_pod["terminationGracePeriodSeconds"] >= drain_s + 20
