"""The bundled model's deterministic prompts, asked for from several threads at once."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_threads_asking_for_prompts_at_once_all_get_them() -> None:
    """A benchmark's streams start together, each building its prompt: the tokenizer's
    first load (transformers' lazy import) must not fail in any of them. In a fresh
    interpreter: the first load is what is tested."""
    script = textwrap.dedent(
        """
        import threading
        from sgl_pd.cluster.prompts import long_prompt_ids
        got, failed = {}, []
        def build(i):
            try:
                got[i] = long_prompt_ids(100, start=1000 * i)
            except Exception as e:
                failed.append(repr(e))
        threads = [threading.Thread(target=build, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not failed, failed
        assert sorted(got) == list(range(8)) and all(len(v) == 100 for v in got.values())
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
