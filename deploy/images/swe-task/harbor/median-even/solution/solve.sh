#!/bin/bash
# The oracle: the fix, made the way an agent would make it (edit the file in place).
set -euo pipefail
cd /repo
python3 - <<'PY'
from pathlib import Path

path = Path("statlib/stats.py")
old = "    return data[mid]\n"
new = "    if len(data) % 2:\n        return data[mid]\n    return (data[mid - 1] + data[mid]) / 2\n"
text = path.read_text()
assert text.count(old) == 1, "unexpected stats.py"
path.write_text(text.replace(old, new))
PY
