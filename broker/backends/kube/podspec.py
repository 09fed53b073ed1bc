"""The sandbox pod manifest, and the objects that must exist before it (execd, owner, guard).

Shape (paper lessons): unmodified task image; execd from an immutable ConfigMap mounted
read-only and run as the container command; requests == limits; no Service links (with
thousands of Services every container got ~23k variables); no service-account token; no
Service per pod (pods are addressed by IP); readiness probe on execd; topology spread over
hosts and zones so one node or subnet doesn't take a whole burst; restartPolicy Never
(a restarted container would silently lose the rollout's state). The execd token is a
per-pod Secret mounted as a file (``kubectl get pod -o yaml`` shows only its name), owned
by the job's owner object like the pod, labelled like the pod, and deleted with it.
"""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from typing import Any

from broker import names
from broker.backends.base import (
    EXECD_LAUNCH,
    LABEL_EGRESS,
    LABEL_INSTALLATION,
    LABEL_JOB,
    MANAGED_BY,
    PodSpec,
)

EXECD_MOUNT = "/opt/sandman"
TOKEN_DIR = "/var/run/sandman-execd"  # noqa: S105 (where the Secret is mounted)
DEFAULT_WORKDIR = "/workspace"  # the request's default "/", as on the local backend
TOKEN_KEY = "token"  # noqa: S105 (the key inside the Secret)
EXECD_DIR = Path(__file__).resolve().parents[3] / "execd"


def execd_files() -> dict[str, str]:
    """The daemon's source files, keyed by file name (ConfigMap keys can't contain '/')."""
    return {p.name: p.read_text() for p in sorted(EXECD_DIR.glob("*.py"))}


def execd_configmap_name(files: dict[str, str]) -> str:
    digest = hashlib.sha256()
    for name, text in sorted(files.items()):
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
    return f"sandman-execd-{digest.hexdigest()[:12]}"


def execd_configmap(name: str, files: dict[str, str], installation: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": name,
            "labels": {LABEL_INSTALLATION: installation, MANAGED_BY: "sandman-broker"},
        },
        "immutable": True,
        "data": files,
    }


def owner_name(job: str) -> str:
    return f"sandman-job-{job}"[:253]


def owner_configmap(job: str, installation: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": owner_name(job),
            "labels": {
                LABEL_INSTALLATION: installation,
                LABEL_JOB: job,
                MANAGED_BY: "sandman-broker",
            },
        },
        "data": {"purpose": "owner of this job's sandbox pods; deleting it deletes them"},
    }


def owner_reference(job: str, owner_uid: str) -> dict[str, Any]:
    """The job's owner object: deleting it deletes every pod and token Secret of the job."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": owner_name(job),
        "uid": owner_uid,
        "blockOwnerDeletion": False,
        "controller": False,
    }


def token_secret_name(pod: str) -> str:
    return f"{pod}-execd-token"[:253]


def token_secret(spec: PodSpec, owner_uid: str) -> dict[str, Any]:
    """The pod's execd token, kept out of the pod object (an env value shows in its yaml)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "immutable": True,
        "metadata": {
            "name": token_secret_name(spec.name),
            "labels": spec.labels(),  # nonce included: delete checks it like the pod's
            "ownerReferences": [owner_reference(spec.job, owner_uid)],
        },
        "data": {TOKEN_KEY: base64.b64encode(spec.token.encode()).decode()},
    }


def ingress_policy_name(installation: str) -> str:
    return f"sandman-ingress-{installation}"[:253]


def ingress_policy(installation: str, port: int) -> dict[str, Any]:
    """Only pods of namespaces labelled ``execd-access=allowed`` may reach a sandbox.

    Why: execd's gate makes a token-less caller cheap, but a sandbox should not even
    connect to another sandbox's execd (a rollout probing its neighbours), nor to any
    other port a task opens. Selected: every sandbox pod of this installation, so
    ingress is denied except this rule. Host-network callers (the kubelet's probes, a
    broker outside the cluster) are not pods of a namespace; the local cluster's engine
    never queues host traffic, as most CNIs allow node-to-pod probes.
    """
    access = {names.LABEL_EXECD_ACCESS: names.EXECD_ACCESS_ALLOWED}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": ingress_policy_name(installation),
            "labels": {LABEL_INSTALLATION: installation, MANAGED_BY: "sandman-broker"},
        },
        "spec": {
            "podSelector": {"matchLabels": {LABEL_INSTALLATION: installation}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"namespaceSelector": {"matchLabels": access}}],
                    "ports": [{"protocol": "TCP", "port": port}],
                }
            ],
        },
    }


def egress_policy_name(job: str) -> str:
    return f"sandman-egress-{job}"[:253]


def egress_policy(job: str, installation: str, allow: list[str]) -> dict[str, Any]:
    """Deny all egress from the job's denied pods, except the listed CIDRs."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": egress_policy_name(job),
            "labels": {
                LABEL_INSTALLATION: installation,
                LABEL_JOB: job,
                MANAGED_BY: "sandman-broker",
            },
        },
        "spec": {
            "podSelector": {
                "matchLabels": {
                    LABEL_INSTALLATION: installation,
                    LABEL_JOB: job,
                    LABEL_EGRESS: "denied",
                }
            },
            "policyTypes": ["Egress"],
            "egress": [{"to": [{"ipBlock": {"cidr": cidr}} for cidr in allow]}] if allow else [],
        },
    }


def pod_workdir(requested: str) -> str:
    """The pod's working directory: the request's, or for the default ``/`` the
    ``/workspace`` the local backend gives too (execd creates it when the image lacks
    it). Never ``/``: a snapshot's default root is the workdir, and ``/`` would be the
    whole filesystem (``/proc`` included)."""
    return DEFAULT_WORKDIR if requested.rstrip("/") == "" else requested


def pod_manifest(
    spec: PodSpec, *, execd_configmap: str, execd_keys: list[str], port: int, owner_uid: str
) -> dict[str, Any]:
    cpu, memory = f"{spec.cpu_m}m", str(spec.memory_b)
    env = [{"name": k, "value": v} for k, v in sorted(spec.env.items())]
    env += [
        {"name": "PYTHONPATH", "value": EXECD_MOUNT},
        {"name": "PYTHONDONTWRITEBYTECODE", "value": "1"},
        {"name": "SANDMAN_EXECD_TOKEN_FILE", "value": f"{TOKEN_DIR}/{TOKEN_KEY}"},
    ]
    spread_selector = {"matchLabels": {LABEL_INSTALLATION: spec.installation, LABEL_JOB: spec.job}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": spec.name,
            "labels": spec.labels(),
            "ownerReferences": [owner_reference(spec.job, owner_uid)],
        },
        "spec": {
            "restartPolicy": "Never",
            "enableServiceLinks": False,
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 1,
            "nodeSelector": dict(spec.node_selector),
            "tolerations": list(spec.tolerations),
            "topologySpreadConstraints": [
                {
                    "maxSkew": 1,
                    "topologyKey": "kubernetes.io/hostname",
                    "whenUnsatisfiable": "ScheduleAnyway",
                    "labelSelector": spread_selector,
                },
                {
                    "maxSkew": 1,
                    "topologyKey": "topology.kubernetes.io/zone",
                    "whenUnsatisfiable": "ScheduleAnyway",
                    "labelSelector": spread_selector,
                },
            ],
            "containers": [
                {
                    "name": "sandbox",
                    "image": spec.image,
                    "imagePullPolicy": "IfNotPresent",
                    "command": [
                        "python3",
                        *EXECD_LAUNCH,
                        "--listen",
                        f"0.0.0.0:{port}",
                        "--workdir",
                        pod_workdir(spec.workdir),
                        "--make-workdir",
                    ],
                    "env": env,
                    "ports": [{"name": "execd", "containerPort": port}],
                    "resources": {
                        "requests": {"cpu": cpu, "memory": memory},
                        "limits": {"cpu": cpu, "memory": memory},
                    },
                    "readinessProbe": {
                        "httpGet": {"path": "/healthz", "port": port},
                        "periodSeconds": 1,
                        "failureThreshold": 3,
                        "timeoutSeconds": 1,
                    },
                    "volumeMounts": [
                        {"name": "execd", "mountPath": f"{EXECD_MOUNT}/execd", "readOnly": True},
                        {"name": "execd-token", "mountPath": TOKEN_DIR, "readOnly": True},
                    ],
                }
            ],
            "volumes": [
                {
                    "name": "execd",
                    "configMap": {
                        "name": execd_configmap,
                        "items": [{"key": k, "path": k} for k in execd_keys],
                    },
                },
                {
                    "name": "execd-token",
                    "secret": {
                        "secretName": token_secret_name(spec.name),
                        "items": [{"key": TOKEN_KEY, "path": TOKEN_KEY}],
                        "defaultMode": 0o400,
                    },
                },
            ],
        },
    }


def prepull_name(installation: str, job: str, image: str) -> str:
    """One DaemonSet per (installation, job, pinned image): stable, so a reconcile
    pass finds the one it made before."""
    digest = hashlib.sha256(f"{installation}|{job}|{image}".encode()).hexdigest()[:16]
    return f"sm-prepull-{digest}"


def prepull_daemonset(
    *,
    installation: str,
    job: str,
    image: str,
    node_selector: dict[str, str],
    tolerations: list[dict[str, Any]],
    owner_uid: str,
) -> dict[str, Any]:
    """Pull ``image`` onto every node the job's sandboxes may land on, and keep it there.

    The pod runs the image itself (``python3``, which every task image has for execd),
    sleeping at a minimal request: an image in use is never removed by the kubelet's
    image GC, so a pre-pulled image stays pulled for as long as the job wants it. It
    carries the prepull label instead of the installation label: no nonce, no ledger
    row, invisible to the pod GC; deleting the job's owner ConfigMap deletes it too."""
    labels = {
        names.LABEL_PREPULL: installation,
        names.LABEL_PREPULL_JOB: job,
        names.MANAGED_BY: "sandman-broker",
    }
    name = prepull_name(installation, job, image)
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {
            "name": name,
            "labels": labels,
            "annotations": {"sandman.io/image": image},
            "ownerReferences": [owner_reference(job, owner_uid)],
        },
        "spec": {
            "selector": {"matchLabels": {"sandman.io/prepull": name}},
            "template": {
                "metadata": {"labels": {**labels, "sandman.io/prepull": name}},
                "spec": {
                    "enableServiceLinks": False,
                    "automountServiceAccountToken": False,
                    "terminationGracePeriodSeconds": 0,
                    "nodeSelector": dict(node_selector),
                    "tolerations": list(tolerations),
                    "containers": [
                        {
                            "name": "hold",
                            "image": image,
                            "imagePullPolicy": "IfNotPresent",
                            "command": [
                                "python3",
                                "-c",
                                "import signal; signal.signal(signal.SIGTERM, "
                                "lambda *a: exit(0)); signal.pause()",
                            ],
                            "resources": {
                                "requests": {"cpu": "1m", "memory": "16Mi"},
                                "limits": {"cpu": "50m", "memory": "32Mi"},
                            },
                        }
                    ],
                },
            },
        },
    }
