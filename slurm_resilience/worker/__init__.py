"""The rank's side: a training loop's session, in recovery order.

heartbeat → reconnect → restore → rollback; ``session`` ties them together.
"""
