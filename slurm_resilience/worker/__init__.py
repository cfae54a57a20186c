"""The rank's side: a training loop's session, in recovery order.

heartbeat → membership (plan, fence, join; reconnect builds the group, parking
releases broken ones) → statesync (restore, reshard, rollback) → safepoint (each
completed step) → endings; ``event_sink`` reports to the supervisor and
``session`` is the facade that ties them together.
"""
