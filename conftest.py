"""Every test directory shares the local S3 server fixtures (moto and Ceph RGW)."""

pytest_plugins = ["loom_store_s3.pytest_plugin"]
