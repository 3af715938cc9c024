"""The decode role: its KV manager and messenger, which ask prefill ranks for a request's
KV (`messenger`), count their completion words (`completion`), grant receive staging
(`staging_grants`), SGLang's KV receiver, and direct mode's dispatch of client requests
to a prefill server.

Whether anything may still land in a request's pages or receive staging - may they be
freed? - is decided in one place, the release rule `release.nothing_can_land`: SGLang's
deferred release asks it through `DecodeMessenger.is_release_safe`.
"""
