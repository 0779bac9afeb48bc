"""What runs an engine: the worker (polls, slots, queues, graceful stop), the `loom`
command line, the deploy tools (replay-check, migrate) and the demo. The top layer:
nothing in the kernel imports it.
"""
