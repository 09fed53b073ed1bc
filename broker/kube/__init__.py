"""The Kubernetes backend. Only ``broker.kube.api`` imports the kubernetes client."""
