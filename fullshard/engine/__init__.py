"""The sharding engine: layout, sharded parameters, buckets, units, hooks and wrap policies.

It never imports `fullshard.api`, `fullshard.checkpoint` or `fullshard.launch`.
"""
