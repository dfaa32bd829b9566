"""What a job's worker scripts ask the scheduler (its status page), for fault tests."""

import json
import os
import urllib.request


def server_pids() -> list[int]:
    """The servers' pids, in rank order."""
    url = f"http://{os.environ['AKV_SCHEDULER_HOST']}:{os.environ['AKV_SCHEDULER_PORT']}/v1/status"
    request = urllib.request.Request(
        url, headers={"Authorization": f"Bearer {os.environ['AKV_TOKEN']}"}
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        nodes = json.load(answer)["nodes"]
    servers = sorted((n for n in nodes if n["role"] == "server"), key=lambda n: n["rank"])
    return [n["pid"] for n in servers]
