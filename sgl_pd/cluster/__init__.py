"""Starting and stopping local SGLang servers and routers (demo, tests, benchmarks)."""
