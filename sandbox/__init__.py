"""Host-side execution of agent code: pool, isolation backends, MLE tasks and graders.

Imports nothing from ``ace_jax`` or ``models``.
"""
