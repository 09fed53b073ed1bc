"""The authenticated readiness poll: Ready means the pod is Ready AND execd answers us.

A pod's Ready condition only says the unauthenticated /healthz answered; an exec with our
token proves the right daemon, with the right token, serves commands.
"""

from __future__ import annotations

import http.client
import json


def execd_answers(address: str, token: str, *, timeout_s: float = 5.0) -> bool:
    host, _, port = address.rpartition(":")
    conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout_s)
    try:
        body = json.dumps({"command": "true", "timeout": timeout_s}).encode()
        conn.request(
            "POST",
            "/v1/exec",
            body=body,
            headers={
                "Authorization": f"Bearer {token}",
                "Content-Type": "application/json",
            },
        )
        resp = conn.getresponse()
        payload = resp.read()
        if resp.status != 200:
            return False
        return bool(json.loads(payload).get("exit_code") == 0)
    except (OSError, ValueError, http.client.HTTPException):
        return False
    finally:
        conn.close()
