"""Helpers shared by the test modules, one module for each thing they drive."""
