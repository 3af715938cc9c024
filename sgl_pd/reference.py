"""Reference pages generated from the code, so that they cannot drift from it:
``python -m sgl_pd.reference`` writes docs/flags.md (every sgl_pd flag of the launcher,
with its default and help, from the same parser `launch_server` uses); the test suite
fails when the committed page differs from what this writes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sgl_pd.config import add_cli_args

FLAGS_PAGE = Path(__file__).resolve().parent.parent / "docs" / "flags.md"


def flags_markdown() -> str:
    parser = argparse.ArgumentParser(add_help=False)
    add_cli_args(parser)
    rows = []
    for action in parser._actions:  # the parser's own record of its flags
        if not action.option_strings:
            continue
        flag = max(action.option_strings, key=len)
        if action.nargs == 0:
            default = "off"
        elif action.default in (None, "", -1, -1.0):
            default = "(none)" if action.default in (None, "") else "derived"
        else:
            default = f"`{action.default}`"
        meaning = " ".join((action.help or "").replace("%%", "%").split())
        if action.choices:
            meaning += " Choices: " + ", ".join(f"`{c}`" for c in action.choices) + "."
        rows.append(f"| `{flag}` | {default} | {meaning.replace('|', '/')} |")
    return "\n".join(
        [
            "# sgl_pd's flags",
            "",
            "`python -m sgl_pd.launch_server` takes SGLang's own arguments and these. This page",
            "is generated from the launcher's parser (`python -m sgl_pd.reference`).",
            "",
            "| flag | default | meaning |",
            "|---|---|---|",
            *rows,
            "",
        ]
    )


def main() -> int:
    FLAGS_PAGE.write_text(flags_markdown())
    print(f"wrote {FLAGS_PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
