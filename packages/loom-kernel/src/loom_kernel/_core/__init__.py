"""The pure core: the error tree, ids, records, events, their codec, the fold, canonical
JSON and the gc walk. It does no I/O, reads no clock and imports no other layer: every
layer above may use it, and it is what a journal means.
"""
