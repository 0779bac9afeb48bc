"""The engine: a small facade (`Engine`) over parts with one job each (the driver, starts,
delivery, recovery, enqueueing, versions, reading), plus run handles, views and
listeners. It imports every layer below it; the hosting layer reaches its parts
through `parts_of`, never through a private member.
"""
