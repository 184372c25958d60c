"""The prefill sender's pending WRITE posts: each waits for the device event recorded
after the kernels that write the KV it reads (``device.py``), and is posted only once that
event completed, so a WRITE never sends KV that is not in the cache yet."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from kvpush.connector.device import Event
from kvpush.connector.push_job import PushJob, WriteBatch


class Post:
    """One WRITE to post: blocks ``start:end`` of ``regions`` of ``job``, once ``event``
    completed."""

    __slots__ = ("batch", "end", "event", "job", "layerwise", "regions", "start")

    def __init__(self, event: Event, job: PushJob, regions: list[int], start: int, end: int,
                 batch: WriteBatch | None, layerwise: bool = False) -> None:
        self.event = event
        self.job = job
        self.regions = regions
        self.start = start
        self.end = end
        self.batch = batch
        self.layerwise = layerwise


class PostQueue:
    """Posts in the order their events were recorded.

    Events of one stream complete in order, so the queue is read from the front and the
    first post whose event is not ready ends a flush. A post queued behind later events
    (a catch-up of blocks from an earlier step) waits for them: later, never too early.
    ``send`` posts a post's WRITEs; nothing here ever waits for an event.
    """

    def __init__(self, send: Callable[[Post], None]) -> None:
        self._send = send
        self._posts: deque[Post] = deque()
        # Pending posts per job. PushJob is an unhashable dataclass: its id stays unique
        # while a queued post references the job.
        self._held: dict[int, int] = {}

    def __bool__(self) -> bool:
        return bool(self._posts)

    def __len__(self) -> int:
        return len(self._posts)

    def submit(self, post: Post) -> None:
        """Send ``post`` now if its data is in the cache and nothing waits before it, else
        queue it (and send whatever is ready)."""
        if not self._posts and post.event.ready():
            self._send(post)
            return
        self.add(post)
        self.flush()

    def flush(self) -> None:
        """Send the queued posts whose events completed, in order."""
        while (post := self.pop_ready()) is not None:
            self._send(post)

    def add(self, post: Post) -> None:
        """Queue ``post`` behind every post queued before it."""
        self._posts.append(post)
        key = id(post.job)
        self._held[key] = self._held.get(key, 0) + 1

    def pop_ready(self) -> Post | None:
        """The first post if its event completed (it leaves the queue); else None."""
        posts = self._posts
        if not posts or not posts[0].event.ready():
            return None
        post = posts.popleft()
        key = id(post.job)
        left = self._held[key] - 1
        if left:
            self._held[key] = left
        else:
            del self._held[key]
        return post

    def holds(self, job: PushJob) -> bool:
        """True while ``job`` has a post not posted yet."""
        return id(job) in self._held

    def drop(self, job: PushJob) -> None:
        """Forget ``job``'s posts: they are never sent, and its blocks from the first of
        them on count as unwritten again (queued ones counted as written)."""
        if self._held.pop(id(job), None) is None:
            return
        kept: deque[Post] = deque()
        for post in self._posts:
            if post.job is job:
                job.written = min(job.written, post.start)
            else:
                kept.append(post)
        self._posts = kept
