"""`sandboxfs run`: the confined program's view (bubblewrap, seccomp, toolchain, home),
the supervisor that runs it, and the network proxy.
"""
