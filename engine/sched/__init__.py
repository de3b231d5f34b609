"""Scheduling: request state, queue order, admission, retraction and the event loops."""
