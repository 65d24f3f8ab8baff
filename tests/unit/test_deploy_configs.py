"""deploy/: the Kubernetes manifests against the Kubernetes API's JSON schemas (kubernetes-validate)
and the Envoy config parsed into Envoy's own Bootstrap proto (xds-protos); no Envoy binary installs
from the package registries, so Envoy itself does not read it here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")
pytest.importorskip("envoy.config.bootstrap.v3.bootstrap_pb2")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KUBERNETES_VERSION = "1.37.0"  # the newest the installed schemas cover, strict (unknown fields fail)


def manifests() -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / "loom.yaml").read_text()) if d]
    assert docs
    return docs


def by_kind(kind: str) -> dict[str, Any]:
    (found,) = [d for d in manifests() if d["kind"] == kind]
    return found


@pytest.mark.parametrize("doc", manifests(), ids=lambda d: d["kind"])
def test_manifest_is_valid_for_the_kubernetes_api(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_validator_rejects_what_the_api_would() -> None:
    deployment = by_kind("Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):  # a gRPC probe's port must be a number
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    deployment = by_kind("Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpcHealth"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_deployment_probes_health_and_mounts_shared_memory() -> None:
    deployment = by_kind("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    grpc_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
    assert f"--port={grpc_port}" in container["args"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == grpc_port, probe
    # readiness asks for the generation service: NOT_SERVING while loading and from a drain's start
    assert container["readinessProbe"]["grpc"]["service"] == "loom.v1.GenerationService"
    liveness = container["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > pod["terminationGracePeriodSeconds"]
    grace_flag = next(a for a in container["args"] if a.startswith("--graceful-termination-timeout="))
    assert int(grace_flag.split("=")[1]) < pod["terminationGracePeriodSeconds"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == container["resources"]["requests"]["nvidia.com/gpu"]
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]


def test_service_is_headless_and_selects_the_pods() -> None:
    service, deployment = by_kind("Service"), by_kind("Deployment")
    assert service["spec"]["clusterIP"] == "None"  # DNS returns every pod: per-request balancing
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert grpc["appProtocol"] == "kubernetes.io/h2c"


def _load_envoy_types() -> None:
    # typed_config's Any needs its message types in the descriptor pool
    import envoy.extensions.filters.http.router.v3.router_pb2
    import envoy.extensions.filters.network.http_connection_manager.v3.http_connection_manager_pb2
    import envoy.extensions.retry.host.previous_hosts.v3.previous_hosts_pb2
    import envoy.extensions.upstreams.http.v3.http_protocol_options_pb2  # noqa: F401


def envoy_bootstrap(config: dict[str, Any]) -> Any:
    from envoy.config.bootstrap.v3 import bootstrap_pb2
    from google.protobuf import json_format

    _load_envoy_types()
    return json_format.ParseDict(config, bootstrap_pb2.Bootstrap())  # unknown fields and bad types raise


def envoy_config() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load((DEPLOY / "envoy" / "envoy.yaml").read_text())
    return config


def test_envoy_config_parses_as_envoys_bootstrap() -> None:
    from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm
    from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2 as upstream_http

    bootstrap = envoy_bootstrap(envoy_config())
    (cluster,) = bootstrap.static_resources.clusters
    assert cluster.lb_policy == cluster.LEAST_REQUEST
    (check,) = cluster.health_checks
    assert check.grpc_health_check.service_name == "loom.v1.GenerationService"
    options = upstream_http.HttpProtocolOptions()
    cluster.typed_extension_protocol_options["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"].Unpack(options)
    assert options.explicit_http_config.HasField("http2_protocol_options")  # gRPC needs HTTP/2 upstream
    (listener,) = bootstrap.static_resources.listeners
    manager = hcm.HttpConnectionManager()
    listener.filter_chains[0].filters[0].typed_config.Unpack(manager)
    routes = [r for vh in manager.route_config.virtual_hosts for r in vh.routes]
    assert {r.route.cluster for r in routes} == {cluster.name}  # every route goes to a defined cluster
    assert all(r.route.timeout.ToSeconds() == 0 for r in routes)  # streams are not cut by Envoy
    assert all("unavailable" in r.route.retry_policy.retry_on.split(",") for r in routes)
    endpoint = cluster.load_assignment.endpoints[0].lb_endpoints[0].endpoint.address.socket_address
    service = by_kind("Service")
    assert endpoint.address.startswith(service["metadata"]["name"] + ".")
    assert endpoint.port_value == next(p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc")


def test_envoy_check_rejects_a_misspelled_field() -> None:
    from google.protobuf import json_format

    config = envoy_config()
    config["static_resources"]["clusters"][0]["lb_polcy"] = "ROUND_ROBIN"
    with pytest.raises(json_format.ParseError, match="lb_polcy"):
        envoy_bootstrap(config)
