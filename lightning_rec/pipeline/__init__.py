"""The sharded pipeline: routing, input dist -> lookup -> output dist, sharded collections and their state.

Public names are re-exported by :mod:`lightning_rec.sharding`; the modules here are internal.
"""
