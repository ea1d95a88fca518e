"""``python -m noria`` is the ``noria`` command."""

from noria.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
