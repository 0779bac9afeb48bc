"""`python -m loom_kernel`: the `loom` command line."""

from loom_kernel._hosting._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
