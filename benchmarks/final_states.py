"""Keeps what a terminal would show at the end: each line's text after its last carriage
return (a progress bar's last state), from standard input to standard output, line by
line as it comes. `record.sh` pipes a benchmark's output through it into the result;
`python benchmarks/final_states.py FILE...` rewrites recorded results in place."""

from __future__ import annotations

import io
import sys
from pathlib import Path


def final_state(line: str) -> str:
    """The text a terminal shows for `line` once every carriage return redrew it."""
    ending = "\n" if line.endswith("\n") else ""
    body = line[: len(line) - len(ending)].rstrip("\r")
    return body.rsplit("\r", 1)[-1] + ending


def main(argv: list[str]) -> int:
    if argv:
        for name in argv:
            path = Path(name)
            with path.open(newline="\n") as f:  # (a carriage return does not end a line)
                lines = [final_state(line) for line in f]
            with path.open("w", newline="") as f:
                f.writelines(lines)
        return 0
    for line in io.TextIOWrapper(sys.stdin.buffer, newline="\n"):
        sys.stdout.write(final_state(line))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
