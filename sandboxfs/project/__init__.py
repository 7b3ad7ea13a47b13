"""A project on disk: the state dir's layout, its sessions, the mount table, the
control channel, and what the user's git says about the project.
"""
