"""Snapshots of a sandbox's workspace, and restoring them into fresh sandboxes (fork).

``store`` is the content-addressed blob store (one seam, the filesystem default),
``service`` drives execd's capture and restore calls between a sandbox and the store,
``collect`` is their share of the GC and the audit.
"""
