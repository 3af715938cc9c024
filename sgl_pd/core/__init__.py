"""Pure core: layouts, sharding, transfer plans, completion counting, wire messages, states.

Imports only the standard library, numpy and msgspec (the wire codec); a test enforces it.

    layout     KvLayout: per-shard pool geometry (NHD/HND), byte spans, compat hash
    regions    RegionTable: a shard's registered (base, length) per (layer, part)
    sharding   ShardingScheme, link_shards: who sends which heads to whom (D12-D14)
    plan       plan_transfer -> TransferPlan: coalesced writes, per-layer address batches
    counting   write groups, per-source count words, CompletionCounter (D10)
    wire       tagged msgspec messages in checked frames (FrameCodec)
    states     request state machines of both roles, clock-driven timeouts
    clock      Clock protocol, SystemClock, ManualClock
    errors     the core's error classes (all SglPdError)
"""
