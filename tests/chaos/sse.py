"""A client of one job's server-sent events that survives the API going away: it reconnects with
``Last-Event-ID`` (as a browser's EventSource does) until the stream ends with a terminal event."""

from __future__ import annotations

import json
import threading
import time

import httpx

from tests.chaos.checker import TERMINAL
from tests.chaos.harness import API_KEY

FOLLOW_S = 240.0


class SseFollower:
    def __init__(self, base_url: str, job_id: str):
        self.url = f"{base_url}/v1/jobs/{job_id}/events"
        self.job_id = job_id
        self.ids: list[str] = []
        self.statuses: list[str] = []
        self.reconnects = 0
        self._first = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)

    def start(self) -> SseFollower:
        self._thread.start()
        return self

    def wait_first_event(self, timeout_s: float = 30) -> None:
        assert self._first.wait(timeout_s), f"no event of {self.job_id} within {timeout_s} s"

    def join(self) -> None:
        self._thread.join(FOLLOW_S)

    def _follow(self) -> None:
        deadline = time.monotonic() + FOLLOW_S
        while time.monotonic() < deadline:
            try:
                if self._read_stream():
                    return
            except httpx.HTTPError:
                pass
            self.reconnects += 1
            time.sleep(0.5)

    def _read_stream(self) -> bool:
        """One connection; True once a terminal event arrived."""
        headers = {"X-API-Key": API_KEY}
        if self.ids:
            headers["Last-Event-ID"] = self.ids[-1]
        timeout = httpx.Timeout(10.0, read=60.0)
        with httpx.stream("GET", self.url, headers=headers, timeout=timeout) as response:
            response.raise_for_status()
            event_id, data = None, []
            for line in response.iter_lines():
                if line.startswith("id:"):
                    event_id = line[3:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].strip())
                elif line == "" and data:
                    self.ids.append(str(event_id))
                    self.statuses.append(json.loads("\n".join(data))["status"])
                    self._first.set()
                    if self.statuses[-1] in TERMINAL:
                        return True
                    event_id, data = None, []
        return False
