"""Sharding plans: the sharding kinds, shard geometry, plans and their helpers, the 2D mesh and the planner.

Public names are re-exported by :mod:`lightning_rec.sharding`; the modules here are internal.
"""
