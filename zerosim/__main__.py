"""``python -m zerosim …`` is the ``zerosim`` command (see zerosim/cli/main.py)."""

from zerosim.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
