"""The enforcement core, shared by every front end (the FUSE adapter, the Python API).

It imports neither pyfuse3 nor trio nor anything of sandboxfs outside itself
(tests/unit/test_core.py checks): `guard` applies every rule and writes every audit entry,
`entry` names every audit op and builds every entry (the guard's, and those written outside it),
`policy` holds the pure tables (trust levels, zones, matrix, patterns), `limits` the per-zone
limits and the quota tally, `context` the security context, `store` the directory-descriptor
store (the only code that resolves backing names), `syscalls` the calls the os module lacks.
"""
