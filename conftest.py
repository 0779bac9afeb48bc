"""Every test directory shares the local S3 server fixtures (moto and Ceph RGW), the
throwaway PostgreSQL cluster, and fresh stores of each kind (`store_kinds`)."""

pytest_plugins = [
    "loom_store_s3.pytest_plugin",
    "loom_store_postgres.pytest_plugin",
    "store_kinds",
]
