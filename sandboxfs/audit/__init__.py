"""The audit log: entries chained by SHA-256 and keyed (log), and the anchor that
keeps the chain's key and head outside every project (anchor).
"""
