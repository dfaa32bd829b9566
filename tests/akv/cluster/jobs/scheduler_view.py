"""What a job's worker scripts ask the scheduler (its status page), for fault tests."""

import json
import os
import urllib.request


def _nodes(path: str = "/v1/status") -> list[dict]:
    url = f"http://{os.environ['AKV_SCHEDULER_HOST']}:{os.environ['AKV_SCHEDULER_PORT']}{path}"
    request = urllib.request.Request(
        url, headers={"Authorization": f"Bearer {os.environ['AKV_TOKEN']}"}
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.load(answer)["nodes"]


def server_pids() -> list[int]:
    """The servers' pids, in rank order."""
    servers = sorted((n for n in _nodes() if n["role"] == "server"), key=lambda n: n["rank"])
    return [n["pid"] for n in servers]


def finished_workers() -> list[int]:
    """The ranks of the workers that closed their stores."""
    return sorted(n["rank"] for n in _nodes() if n["role"] == "worker" and n["finished"])


def scheduler_pid() -> int:
    """The scheduler's pid."""
    (pid,) = [n["pid"] for n in _nodes("/status.json") if n["role"] == "scheduler"]
    return pid
