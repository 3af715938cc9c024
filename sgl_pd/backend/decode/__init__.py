"""The decode role: its KV manager and messenger, which ask prefill ranks for a request's
KV and count their completion words, SGLang's KV receiver, and direct mode's dispatch of
client requests to a prefill server.

Whether an early-ended request's pages may be freed is decided in one place: the
messenger's release check, `DecodeMessenger.is_release_safe` in `messenger.py`.
"""
