"""Loom orchestration: await_child and supervise_children.

Not built yet: this distribution exports nothing until its issue lands
("Orchestration"). See the project's docs/index.md for what is available today.
"""

__all__: list[str] = []
