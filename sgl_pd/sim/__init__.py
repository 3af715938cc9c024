"""Cluster simulator: sizes a PD deployment before it exists (see `__main__` for the CLI).

Pure Python and numpy: a roofline of the model on the GPUs (`roofline`), a discrete-event
engine of prefill, decode and mixed instances with KV transfers over NICs (`engine`),
deployments and their figures (`deploy`), traces (`trace`), the article's figures
(`reproduce`) and a planner (`planner`).
"""
