"""Fault-injection suite: a real local stack, steady load, one fault at a time, full accounting.

``harness`` starts the stack and drives load; ``scenarios`` holds one function per fault;
``failover`` runs the stack on a Sentinel set or a Redis Cluster and kills its master;
``tcp_proxy`` and ``netns`` are the network fault tools. ``tests/test_faults*.py`` (pytest) and
``kvpush reliability`` (``loadtest/reliability.py``, writes RELIABILITY.md) both run them.
"""
