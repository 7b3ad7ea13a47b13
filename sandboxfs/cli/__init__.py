"""The `sandboxfs` command: one module per command group, completion, the man page.

The entry point is `sandboxfs.cli.main:entry`; nothing below this package imports it.
"""

import os

# The command's models are sandboxfs's own: no pydantic plugin installed in the environment is
# loaded into the supervisor or the daemon, and pydantic does not scan every installed
# distribution's entry points to look for one (start-up time of every command). Set before
# anything below imports pydantic; the confined program's environment is built from an
# allowlist and never sees it.
os.environ["PYDANTIC_DISABLE_PLUGINS"] = "__all__"
