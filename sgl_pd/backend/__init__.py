"""sgl_pd as an SGLang disaggregation transfer backend (SGLang-version glue).

SGLang has no backend registry: ``registration`` adds ``sgl_pd`` to SGLang's
``TransferBackend`` enum and to ``get_kv_class``, so SGLang's own flags
(``--disaggregation-mode prefill|decode --disaggregation-transfer-backend sgl_pd``)
select the classes in this package (`roles` picks each scheduler's KV manager by its
mode).

Each role's classes live in `prefill/` and `decode/`; what both roles use (the base
KV manager, liveness, the pool's description, metrics, addresses, /health and the
request hooks of both sides) sits here.
"""
