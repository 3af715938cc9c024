"""Rewrites a Mooncake transfer-engine wheel in place without the parts sgl_pd never
loads (store, expert-parallel and process-group libraries, command-line binaries), so
the wheel fits what a GPU host without network can be handed.

    python3 benchmarks/gpu/slim_wheel.py WHEEL
"""

from __future__ import annotations

import argparse
import os
import re
import zipfile

# what `import mooncake.engine` never loads: it needs engine.so, the libraries beside it
# and those auditwheel bundled (mooncake_transfer_engine.libs)
DROPPED = re.compile(
    r"^mooncake/("
    r"libmooncake_(pg|pg_device|ep_device)\.so|store\.so|nvlink_allocator\.so"
    r"|pg_[0-9_]+\..*\.so|_ep\..*\.so|transfer_engine_bench|mooncake_client|mooncake_master"
    r")$"
)


def slim(path: str) -> tuple[int, int]:
    """Drops DROPPED members (and their RECORD lines); returns (bytes before, after)."""
    before = os.path.getsize(path)
    staged = path + ".slim"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(staged, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if DROPPED.match(info.filename):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                kept = [
                    line
                    for line in data.decode().splitlines()
                    if not DROPPED.match(line.split(",", 1)[0])
                ]
                data = ("\n".join(kept) + "\n").encode()
            dst.writestr(info, data)
    os.replace(staged, path)
    return before, os.path.getsize(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheels", nargs="+")
    for wheel in parser.parse_args().wheels:
        before, after = slim(wheel)
        print(f"{os.path.basename(wheel)}: {before / 2**20:.0f} MiB -> {after / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
