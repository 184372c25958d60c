"""Push scheduler: reads requests from a Redis Streams consumer group, places and reserves them.

The request queue is ``request_shards`` streams (``kvpush:requests``, then
``kvpush:requests:{shard-N}``); every scheduler reads all of them into one wait queue, so a
request's shard changes nothing about where or when it is served. Entry ids are per stream:
an entry is named by its shard and id (``Pending.ref``) wherever two shards could collide.

One asyncio task runs the whole loop, so the local engine view and the waiting queue need no
locks. Per batch of entries the hot path costs two Redis round trips: one pipeline of
``SET once NX GET`` + reserve script per request; one pipeline of the assignment ``XADD``\\s,
dead letters and ``XACK`` followed by the next ``XREADGROUP``.

Requests that find no free decode slot wait in a per-tenant queue served by weighted fair
queueing (:class:`WaitQueue`), with weights from the tenant records: a tenant that floods
lengthens only its own queue. Spans (``process kvpush:requests``, ``kvpush.match``) are
built only when tracing is on.

Exactly-once, as far as the gateway can tell:

* An entry is acknowledged only after its answer (assignment or dead letter) is written.
  A scheduler that dies in between leaves it pending; another one ``XAUTOCLAIM``\\s it after
  ``scheduler_claim_idle_ms`` and answers it again.
* The reservation id is the request id and reserving is idempotent per engine, so a retried
  entry gets the same reservation back as long as it lands on the same engine. The marker
  ``kvpush:once:{RID}`` = ``"<entry ref>|<decode engine>"`` (plain text, read only here)
  records that engine, so a reclaimed entry goes back to it first, and an entry with a
  request id another entry already holds is a duplicate: it is dead-lettered, and a
  reservation it made by accident is released.
* Entries waiting for capacity stay pending under this consumer; their idle time is reset
  (``XCLAIM ... JUSTID``, which does not count as a delivery) so nobody steals them.

The modules follow the push path; README.md in this folder lists them.
"""

from kvpush.services.scheduler.fair_queue import Pending, WaitQueue
from kvpush.services.scheduler.loop import Scheduler, main, run_scheduler
from kvpush.services.scheduler.state import Outbox, Plan, SchedulerError, SchedulerStats

__all__ = [
    "Outbox",
    "Pending",
    "Plan",
    "Scheduler",
    "SchedulerError",
    "SchedulerStats",
    "WaitQueue",
    "main",
    "run_scheduler",
]
