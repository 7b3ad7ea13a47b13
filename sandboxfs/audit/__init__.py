"""The audit log: entries chained by SHA-256 and keyed, in one module per concern.

common (the entry's form and seals, the log's files), writer (AuditLog: appending, rotating,
failing closed), fold (floods of refusals), reserve (room kept for a full disk), markers (live
writers), reader (queries, following), verify (the chain and its anchor), prune (dropping the
oldest entries), and anchor (the chain's key and head, kept outside every project).
"""
