"""Harness packages read their own settings at import: keep them quiet and out of $HOME."""

from __future__ import annotations

import os
import tempfile

# mini-swe-agent prints a banner and creates its global config directory at import time.
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
os.environ.setdefault(
    "MSWEA_GLOBAL_CONFIG_DIR", os.path.join(tempfile.gettempdir(), "sandman-test-mswea")
)
