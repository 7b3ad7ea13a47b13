"""Configuration: the models of a project's `sandboxfs.yaml` (model), the user's own
config and agent profiles (user), and reading the files a user hands sandboxfs (inputs).
"""
