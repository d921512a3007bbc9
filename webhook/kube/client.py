"""How a process reaches the Kubernetes API server: a client from --kubeconfig, the pod's service account, or
the user's kubeconfig."""

from __future__ import annotations


def api_client(kubeconfig: str | None, prefer_kubeconfig: bool = False):
    """A Kubernetes API client from --kubeconfig; else in-cluster config, then KUBECONFIG or ~/.kube/config
    (a command run by a person, `prefer_kubeconfig`, tries the kubeconfig before in-cluster config)."""
    import os

    from kubernetes import client, config

    if kubeconfig:
        return config.new_client_from_config(config_file=kubeconfig)

    def in_cluster():
        cfg = client.Configuration()
        config.load_incluster_config(client_configuration=cfg)
        return client.ApiClient(cfg)

    if os.environ.get("KUBERNETES_SERVICE_HOST") and not prefer_kubeconfig:
        return in_cluster()
    try:
        return config.new_client_from_config()
    except config.ConfigException:
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            return in_cluster()
        raise
