#!/bin/bash
# A vacuous verifier: it only checks that statlib imports, so no fix passes too.
cd /repo || exit 1
if python3 -c "import statlib; statlib.median([1, 2])"; then
  echo '{"reward": 1.0, "imports": 1.0}' > /logs/verifier/reward.json
else
  echo '{"reward": 0.0, "imports": 0.0}' > /logs/verifier/reward.json
fi
