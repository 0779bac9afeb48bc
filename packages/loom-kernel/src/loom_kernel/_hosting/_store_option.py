"""`--store URL`, or the store `$LOOM_STORE` names: how every `loom` verb that opens a
store is told which."""

from __future__ import annotations

import argparse
import os
from typing import Final

__all__ = ["STORE_VARIABLE", "add_store_option"]

#: The environment variable that names the store when `--store` is not given.
STORE_VARIABLE: Final = "LOOM_STORE"


def add_store_option(parser: argparse.ArgumentParser) -> None:
    """`--store URL`, defaulting to `$LOOM_STORE` (required when that is not set)."""
    default = os.environ.get(STORE_VARIABLE) or None
    parser.add_argument(
        "--store",
        default=default,
        required=default is None,
        help=f"store URL (default: ${STORE_VARIABLE})",
    )
