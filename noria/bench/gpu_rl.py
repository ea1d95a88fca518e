"""Placeholder being written (see issue 9 / 10); replaced in this session."""

from __future__ import annotations


def add_arguments(parser) -> None:
    parser.add_argument("--json", help="write the figures to this JSON file")


def main(args) -> int:
    raise SystemExit("noria bench: this benchmark is being written")
