"""The Kubernetes job backend's connection to the API server: the client and its default
namespace (a kubeconfig, or the in-cluster ServiceAccount inside a pod), and what an API error
says."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kubernetes import client as k8s, config as k8s_config
from kubernetes.client.exceptions import ApiException

_IN_CLUSTER_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def api_client(kubeconfig: str) -> tuple[k8s.ApiClient, str]:
    """An API client and its default namespace: from `kubeconfig` when given, in-cluster
    (service account) inside a pod, else the default kubeconfig."""
    if not kubeconfig and os.environ.get("KUBERNETES_SERVICE_HOST"):
        conf = k8s.Configuration()
        k8s_config.load_incluster_config(client_configuration=conf)
        try:
            namespace = Path(_IN_CLUSTER_NAMESPACE).read_text().strip()
        except OSError:
            namespace = "default"
        return k8s.ApiClient(conf), namespace
    path = str(kubeconfig) if kubeconfig else None
    api = k8s_config.new_client_from_config(config_file=path)
    _, active = k8s_config.list_kube_config_contexts(config_file=path)
    return api, (active or {}).get("context", {}).get("namespace") or "default"


def why(exc: ApiException) -> str:
    """`403 Forbidden: <the Status's message>`, naming what was refused."""
    try:
        return f"{exc.status} {exc.reason}: {json.loads(exc.body)['message']}"
    except (TypeError, ValueError, KeyError):
        return f"{exc.status} {exc.reason}"
