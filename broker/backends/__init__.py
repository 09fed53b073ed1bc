"""Where sandboxes run: Kubernetes pods, or local execd processes under bubblewrap.

Both implement :class:`broker.backends.base.Backend`; the ownership protocol in
``broker.ownership.provider`` is written once against that seam.
"""
