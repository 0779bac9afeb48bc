"""The storage SPI and what the kernel is given from outside: `JournalStore` (the
checked operations a store implements), the fault-injection seam, the `memory://`
reference store, stores by URL scheme, and the fake clock. It imports only the core.
"""
