"""CPU harness: what lets real SGLang serve on a machine without a GPU.

Only one thing is stood in for: the driver library that the sgl-kernel wheel links
(``libcuda_stub.c``). Everything else about the CPU path is SGLang's own CPU engine,
selected by flags and environment in :mod:`sgl_pd.harness.cpu`.
"""
