"""The replay context: a flow's code run once from the top against its folded journal.
Each ctx operation's decision (claim, replay or decide, record) is made in one place;
the sync and async contexts are thin faces over it, and a drive reaches the store only
through the record its host gives it. It imports the core and the SPI.
"""
