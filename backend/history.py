"""Each user's job history: the ids of the jobs they submitted, newest first.

One Redis sorted set per owner (``keys.history_key``), scored by submission time and trimmed to the
newest ``limit`` ids; it expires with the job state (``ttl_s`` after the owner's last submission;
never when job records never expire), so a history never lists more than the job state still holds
for long. Owners are hashed into the key: a user name or an API key never appears in a Redis key.
"""

from __future__ import annotations

from redis import Redis

from backend.jobstate import JOB_TTL_S
from backend.protocol import to_text
from backend.protocol.keys import history_key


class HistoryIndex:
    def __init__(self, client: Redis, limit: int, ttl_s: int = JOB_TTL_S):
        self.client, self.limit, self.ttl_s = client, int(limit), int(ttl_s)

    def add(self, owner: str, job_id: str, at: float) -> None:
        """Record that ``owner`` submitted ``job_id`` at ``at``; keeps the newest ``limit``."""
        if not owner:
            return
        key = history_key(owner)
        with self.client.pipeline(transaction=True) as pipe:
            pipe.zadd(key, {job_id: at})
            pipe.zremrangebyrank(key, 0, -self.limit - 1)
            if self.ttl_s > 0:
                pipe.expire(key, self.ttl_s)
            pipe.execute()

    def job_ids(self, owner: str, limit: int | None = None) -> list[str]:
        """The owner's job ids, newest first (at most ``limit``)."""
        if not owner:
            return []
        count = min(self.limit, limit or self.limit)
        return [to_text(jid) for jid in self.client.zrevrange(history_key(owner), 0, count - 1)]

    def forget(self, owner: str, job_id: str) -> None:
        self.client.zrem(history_key(owner), job_id)
