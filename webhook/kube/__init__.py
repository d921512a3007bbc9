"""The Kubernetes adapters: the runtime watch and cache, live reads, live settings, token reviews."""
