"""Kiln inside other systems: ``kiln.integrations.ray`` runs batch inference on Ray Data.

Each integration imports its framework only when used and says which extra installs it
when it is missing.
"""
