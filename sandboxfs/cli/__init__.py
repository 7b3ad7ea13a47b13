"""The `sandboxfs` command: one module per command group, completion, the man page.

The entry point is `sandboxfs.cli.main:main`; nothing below this package imports it.
"""
