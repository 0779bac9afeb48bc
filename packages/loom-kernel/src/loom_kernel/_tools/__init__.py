"""Tools that read code or journals and change nothing: `loom lint` (what makes a flow
non-deterministic) and the timeline printer. They import the layers below them.
"""

from loom_kernel._tools._lint import lint_paths, lint_source, python_files
from loom_kernel._tools._timeline import format_timeline

__all__ = [
    "format_timeline",
    "lint_paths",
    "lint_source",
    "python_files",
]
