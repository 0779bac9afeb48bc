"""Loom's S3 store: the journal SPI on S3 conditional writes.

Not built yet: this distribution exports nothing until its issue lands
("The S3 store"). See the project's docs/index.md for what is available today.
"""

__all__: list[str] = []
