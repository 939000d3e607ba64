"""What a job process's exit code tells the worker and the scheduler.

0: the job ended by itself (a result, a cancel); any other code by itself: the job failed (its
reason was reported); killed by a signal (attempts.ended_by_signal): the attempt was lost and
the job is re-queued. ``RETRY_LATER`` is the job's own way to be re-queued: the trainer ends
its attempt over a fault of the node, not of the job (the checkpoint root full, read-only or
forbidden, with ``TrainerSettings.on_storage_error = "requeue"``; a job's ranks that lost
each other, its rank 0 or another node lost: trainer/distributed.group_broke), after reporting
why (a follower rank has no report of its own: its worker's reason says it).
``PEER_LOST`` is the rollout's (a job's own, private one) when its trainer left the stream
unclosed: hung (it stopped answering keepalive pings) or gone. The worker alone reads it: it
kills the trainer if it is still there and reports the attempt lost (worker/job_run.py).
"""

from __future__ import annotations

RETRY_LATER = 75  # EX_TEMPFAIL in sysexits.h: "temporary failure; the user is invited to retry"
PEER_LOST = 76  # EX_PROTOCOL in sysexits.h: "remote error in protocol"
