"""The local image store: import (docker-archive, OCI archive), references to digests, and
each digest's root filesystem unpacked once, for the local backend (see store.py)."""
