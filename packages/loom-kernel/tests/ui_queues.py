"""The queues `loom ui --queues ui_queues:QUEUES` shows in test_ui.py."""

from loom_kernel import Queue

QUEUES = [Queue("capped", concurrency=3)]
