"""The prefill role: its KV manager and messenger, which write each request's pages into
decoders (rooms, writers, the layer-wise hooks), SGLang's KV sender, the registry server
at the bootstrap port with direct-mode submissions, and the pins that hold source pages.

Whether a request's source pages may be freed, and its drain acks sent, is decided in one
place: the drain rule, `drain.Drain.settle`.
"""
