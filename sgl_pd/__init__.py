"""sgl_pd: disaggregated prefill and decode for SGLang.

Importing the package must stay cheap: nothing here imports torch, zmq, mooncake or
sglang. Those live at the edges (``sgl_pd.transfer``, ``sgl_pd.sglang_glue``).
"""

__version__ = "0.1.0"
