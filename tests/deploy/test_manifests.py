"""The Helm chart (``deploy/helm/tinyloop``) and the manifests rendered from it (``deploy/k8s``).

The chart is rendered by Helm's own Go template engine (``helm-python-sdk`` binds Helm's SDK: no
``helm`` binary needed), linted, and every object is checked against the Kubernetes OpenAPI
schema of the release we target (``kubernetes-validate``, strict: unknown fields are errors). The
ServiceMonitor is a CRD that schema set does not carry: its required fields are checked by hand.
``deploy/k8s/tinyloop.yaml`` must be exactly what the chart renders with its defaults
(regenerate: ``python -m tests.deploy.test_manifests``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (the dev extra) renders the chart")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (the dev extra)")
yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "tinyloop"
RENDERED = ROOT / "deploy" / "k8s" / "tinyloop.yaml"
K8S_VERSION = "1.30.0"  # the oldest release we support: preStop, HPA v2 behavior, startupProbe
RELEASE, NAMESPACE = "demo", "default"


def render(values: dict[str, Any] | None = None) -> str:
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values or {}, name=RELEASE, namespace=NAMESPACE)
    header = "# Rendered from deploy/helm/tinyloop with its default values (release demo, namespace default).\n"
    return header + "".join(f"---\n# {name}\n{text.strip()}\n" for name, text in sorted(manifests.items())
                            if text.strip())


def objects(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def test_the_chart_lints_clean() -> None:
    assert helm.lint(str(CHART))["errors"] == []


@pytest.mark.parametrize("values", [{}, {"autoscaling": {"enabled": False}, "serviceMonitor": {"enabled": False},
                                         "router": {"enabled": False}}], ids=["defaults", "bare"])
def test_every_rendered_object_matches_the_kubernetes_schema(values: dict[str, Any]) -> None:
    docs = objects(render(values))
    assert docs
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            assert doc["spec"]["selector"]["matchLabels"] and doc["spec"]["endpoints"][0]["path"] == "/metrics"
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_drain_fits_in_the_termination_grace_period() -> None:
    pod = by_kind(objects(render()), "Deployment")[0]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    graceful = float(env["TINYLOOP_GRACEFUL_TIMEOUT"])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + graceful + 5
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"


def test_the_autoscaler_reads_the_queue_depth_and_the_pods_ask_for_a_gpu() -> None:
    docs = objects(render())
    metric = by_kind(docs, "HorizontalPodAutoscaler")[0]["spec"]["metrics"][0]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == "tinyloop_queue_depth"
    resources = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1


def test_a_multi_gpu_pod_runs_one_engine_per_device() -> None:
    gpus = {"nvidia.com/gpu": 2}
    values = {"devices": "0,1", "resources": {"requests": gpus, "limits": gpus}}
    container = by_kind(objects(render(values)), "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "TINYLOOP_DEVICES", "value": "0,1"} in container["env"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    default = by_kind(objects(render()), "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    assert all(e["name"] != "TINYLOOP_DEVICES" for e in default["env"])


def test_the_router_config_map_carries_the_shipped_haproxy_config() -> None:
    config = by_kind(objects(render()), "ConfigMap")[0]["data"]["haproxy.cfg"]
    assert config.strip() == (ROOT / "deploy" / "router" / "haproxy.cfg").read_text().strip()


def test_the_committed_manifests_are_the_chart_rendered() -> None:
    assert RENDERED.read_bytes().decode() == render(), "regenerate: python -m tests.deploy.test_manifests"


if __name__ == "__main__":
    RENDERED.write_bytes(render().encode())
