"""Reading sgl_pd's series from a server's /metrics page, for the e2e tests."""

from __future__ import annotations

import re

import requests


def sample(url: str, name: str, **labels: str) -> float:
    """The value of one series (0 when absent): `name` with exactly these labels."""
    text = requests.get(f"{url}/metrics", timeout=30).text
    for match in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} ([0-9.e+-]+)$", text, re.M):
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if found == labels:
            return float(match.group(2))
    return 0.0
