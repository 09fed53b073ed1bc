#!/usr/bin/env python3
"""Pack layer tarballs into a docker-archive image tarball (no registry, no daemon).

The result can be loaded with `ctr -n k8s.io images import FILE` (or `docker load`).

    pack_image.py --out img.tar --tag localhost/x:1 [--tag ...] \
        --layer base.tar [--layer more.tar ...] \
        [--env K=V ...] [--cmd '["/bin/bash"]'] [--entrypoint '["/pause"]'] [--workdir /]

Each --layer is an uncompressed tar of a filesystem diff (paths relative to /).
Only the standard library is used.
"""

import argparse
import hashlib
import io
import json
import os
import sys
import tarfile

FIXED_TIME = "2024-01-01T00:00:00Z"


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def add_bytes(tar, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    info.mtime = 0
    tar.addfile(info, io.BytesIO(data))


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True)
    p.add_argument("--tag", action="append", required=True)
    p.add_argument("--layer", action="append", required=True)
    p.add_argument("--env", action="append", default=[])
    p.add_argument("--cmd")
    p.add_argument("--entrypoint")
    p.add_argument("--workdir", default="/")
    p.add_argument("--label", action="append", default=[])
    a = p.parse_args(argv)

    diff_ids = [sha256_file(layer) for layer in a.layer]
    cfg = {
        "architecture": "amd64",
        "os": "linux",
        "created": FIXED_TIME,
        "config": {
            "Env": a.env or ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            "WorkingDir": a.workdir,
            "Labels": dict(kv.split("=", 1) for kv in a.label) or None,
        },
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + d for d in diff_ids]},
        "history": [
            {"created": FIXED_TIME, "created_by": f"sandman pack_image.py layer {i}"}
            for i in range(len(diff_ids))
        ],
    }
    if a.cmd:
        cfg["config"]["Cmd"] = json.loads(a.cmd)
    if a.entrypoint:
        cfg["config"]["Entrypoint"] = json.loads(a.entrypoint)
    cfg_bytes = json.dumps(cfg, sort_keys=True).encode()
    cfg_name = hashlib.sha256(cfg_bytes).hexdigest() + ".json"
    layer_names = [d + "/layer.tar" for d in diff_ids]
    manifest = [{"Config": cfg_name, "RepoTags": a.tag, "Layers": layer_names}]

    tmp = a.out + ".tmp"
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        seen = set()
        for layer, name in zip(a.layer, layer_names, strict=False):
            if name in seen:
                continue
            seen.add(name)
            info = tarfile.TarInfo(name)
            info.size = os.path.getsize(layer)
            info.mode = 0o644
            with open(layer, "rb") as f:
                tar.addfile(info, f)
        add_bytes(tar, cfg_name, cfg_bytes)
        add_bytes(tar, "manifest.json", json.dumps(manifest).encode())
        repos = {}
        for t in a.tag:
            repo, _, tag = t.rpartition(":")
            repos.setdefault(repo, {})[tag] = diff_ids[-1]
        add_bytes(tar, "repositories", json.dumps(repos).encode())
    os.replace(tmp, a.out)
    print(a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
