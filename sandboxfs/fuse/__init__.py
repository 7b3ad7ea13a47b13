"""The mount: the only package that imports pyfuse3 and trio (daemon, the FUSE adapter,
attribute replies, how the daemon waits for requests).
"""
