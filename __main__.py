"""`python -m linearize` (and `accelerate launch -m linearize`) runs the CLI."""

from linearize.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
