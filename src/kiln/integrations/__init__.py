"""Kiln inside other systems: ``kiln.integrations.ray`` runs batch inference on Ray Data,
``kiln.integrations.ray_train`` fine-tunes imported models on Ray Train.

Each integration imports its framework only when used and says which extra installs it
when it is missing.
"""
