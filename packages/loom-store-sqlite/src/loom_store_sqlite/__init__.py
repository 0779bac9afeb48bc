"""Loom's embedded default store: the journal SPI on SQLite.

Not built yet: this distribution exports nothing until its issue lands
("The SQLite store"). See the project's docs/index.md for what is available today.
"""

__all__: list[str] = []
