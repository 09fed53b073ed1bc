#!/bin/bash
# Harbor verifier: the hidden tests against the agent's repository; reward 1 if all pass.
cd /repo || exit 1
if PYTHONPATH=/repo python3 -m unittest discover -v -s /tests -t /tests -p 'test_*.py'; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
