"""Tools that read code or journals and change nothing: `loom lint` (what makes a flow
non-deterministic) and the timeline printer. They import the layers below them.
"""
