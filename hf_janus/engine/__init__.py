"""The JANUS algorithm on plain linear layers: capture, compression, ghost math, the rectifier and its result.

Imports nothing from ``adapters``, ``integrations`` or ``publish``; they read :mod:`.result`.
"""
