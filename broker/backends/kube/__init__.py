"""The Kubernetes backend. Only ``broker.backends.kube.api`` imports the kubernetes client."""
